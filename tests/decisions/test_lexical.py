"""LexicalDecisions: scoring, clarify thresholds, candidate filtering, validation."""

from __future__ import annotations

import gc
import logging
import math
import random
import tracemalloc
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import (
    CLARIFY,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractTypeError,
    RouteRequest,
    RoutingAid,
)
from turnrouter.decisions import LexicalCalibration, LexicalDecisions, description_phrases
from turnrouter.testing import ScriptedAgent

EXAMPLES = {
    "weather": ["what is the weather today", "will it rain tomorrow", "is it sunny outside",
                "weather forecast for the weekend", "how cold is it outside"],
    "music": ["play some jazz music", "put on my playlist", "skip this song",
              "play the next track", "turn the music up"],
    "banking": ["what is my account balance", "transfer money to savings",
                "show my recent transactions", "pay my electricity bill"],
}
AIDS = (
    RoutingAid("weather", "Weather forecasts, rain, temperature and sunshine."),
    RoutingAid("music", "Play songs, music, playlists and albums."),
    RoutingAid("banking", "Bank account balances, transfers, transactions and bills."),
)


def request(query: str, aids: tuple[RoutingAid, ...] = AIDS) -> RouteRequest:
    return RouteRequest(AgentTurn("p1", "t1", query), aids)


@pytest.mark.anyio
async def test_examples_choose_matching_route_with_scores_for_every_candidate() -> None:
    """A query close to one route's examples picks it and scores every candidate."""
    decision = await LexicalDecisions(EXAMPLES).decide(request("will it rain this weekend"))
    assert decision.choice == "weather"
    assert set(decision.scores) == {"weather", "music", "banking"}
    assert decision.scores["weather"] == max(decision.scores.values())
    assert decision.confidence is not None
    assert 0.0 <= decision.confidence <= 1.0
    assert decision.rationale.startswith("lexical: top=weather")


@pytest.mark.anyio
async def test_descriptions_only_choose_matching_route() -> None:
    """Without examples, the name and description decide."""
    decision = await LexicalDecisions().decide(request("play a song from my playlist"))
    assert decision.choice == "music"


@pytest.mark.anyio
async def test_unrelated_query_clarifies_without_usable_scores() -> None:
    """A query matching no route well enough answers clarify with no score a router
    could pick from; keep_scores=True shows them all."""
    service = LexicalDecisions(EXAMPLES)
    decision = await service.decide(request("xylophone zebra quantum"))
    assert decision.choice == CLARIFY
    assert dict(decision.scores) == {}
    assert "clarify" in decision.rationale
    kept = service.score(request("xylophone zebra quantum"), keep_scores=True)
    assert set(kept.scores) == {"weather", "music", "banking"}
    assert kept.confidence == decision.confidence == max(kept.scores.values())


@pytest.mark.anyio
@pytest.mark.parametrize("wrong", [AgentTurn("p1", "t1", "will it rain"), "will it rain",
                                   None])
async def test_decide_names_what_it_takes_when_given_something_else(wrong: object) -> None:
    """Called by hand with a turn (a natural first try) instead of the RouteRequest the
    router builds: the error names both, not a bare AttributeError on `candidates`."""
    with pytest.raises(ContractTypeError, match=r"takes a RouteRequest .* got "):
        await LexicalDecisions(EXAMPLES).decide(wrong)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_empty_query_clarifies() -> None:
    """An empty query has no features and answers clarify."""
    decision = await LexicalDecisions(EXAMPLES).decide(request(""))
    assert decision.choice == CLARIFY


@pytest.mark.anyio
async def test_close_runner_up_clarifies_under_margin() -> None:
    """Two routes scoring within min_margin answer clarify."""
    aids = (RoutingAid("alpha", "red apples"), RoutingAid("omega", "red apples"))
    service = LexicalDecisions(min_margin=0.05, min_description_score=0.0)
    decision = await service.decide(request("red apples", aids))
    assert decision.choice == CLARIFY
    assert decision.scores["alpha"] == decision.scores["omega"]


@pytest.mark.anyio
async def test_exact_tie_goes_to_higher_priority_then_earlier() -> None:
    """With no margin required, an exact tie is broken by priority, then order."""
    service = LexicalDecisions(min_margin=0.0, min_description_score=0.0)
    low_first = (RoutingAid("alpha", "red apples"), RoutingAid("omega", "red apples", priority=5))
    assert (await service.decide(request("red apples", low_first))).choice == "omega"
    same = (RoutingAid("alpha", "red apples"), RoutingAid("omega", "red apples"))
    assert (await service.decide(request("red apples", same))).choice == "alpha"


@pytest.mark.anyio
async def test_min_score_threshold_controls_clarify() -> None:
    """Raising min_example_score to 1 turns a good match into clarify."""
    strict = LexicalDecisions(EXAMPLES, min_example_score=1.0)
    decision = await strict.decide(request("will it rain tomorrow"))
    assert decision.choice == CLARIFY
    assert dict(decision.scores) == {}
    assert strict.score(request("will it rain tomorrow"), keep_scores=True
                        ).scores["weather"] > 0.0


@pytest.mark.anyio
async def test_examples_of_non_candidates_are_ignored() -> None:
    """Only the request's candidates are scored and chosen."""
    aids = (AIDS[1], AIDS[2])
    decision = LexicalDecisions(EXAMPLES).score(request("will it rain tomorrow", aids),
                                                keep_scores=True)
    assert set(decision.scores) == {"music", "banking"}
    assert decision.choice in {"music", "banking", CLARIFY}


@pytest.mark.anyio
async def test_candidate_without_examples_uses_description() -> None:
    """A candidate with no examples is scored from its routing aid."""
    aids = (*AIDS, RoutingAid("recipes", "Cooking recipes, ingredients and baking."))
    decision = await LexicalDecisions(EXAMPLES).decide(
        request("give me a recipe for baking bread", aids)
    )
    assert decision.choice == "recipes"


@pytest.mark.anyio
async def test_no_candidates_clarifies() -> None:
    """A request with no candidates answers clarify."""
    decision = await LexicalDecisions(EXAMPLES).decide(request("rain", ()))
    assert decision.choice == CLARIFY


def test_best_phrase_lifts_a_route_whose_long_description_lists_the_query() -> None:
    """A query naming one item of an enumeration scores higher with the phrase part."""
    aids = (
        RoutingAid("travel", "Flights, hotels, rental cars, visas, vaccines, luggage, "
                   "passports, cruises, trains and time zones."),
        RoutingAid("utility", "The time of day and alarms."),
    )
    query = request("which vaccines do i need", aids)
    whole_only = LexicalDecisions(phrase_weight=0.0, min_description_score=0.0).score(query)
    blended = LexicalDecisions(phrase_weight=0.5, min_description_score=0.0).score(query)
    assert blended.choice == "travel"
    assert blended.scores["travel"] > whole_only.scores["travel"]
    assert blended.scores["utility"] < blended.scores["travel"]


def test_route_name_is_a_phrase_of_its_own() -> None:
    """A query matching only the route name still reaches it through the name phrase."""
    aids = (RoutingAid("payroll_taxes", "Questions for the finance team."),
            RoutingAid("music", "Play songs and albums."))
    decision = LexicalDecisions(min_description_score=0.0).score(
        request("payroll taxes", aids)
    )
    assert decision.choice == "payroll_taxes"
    assert decision.scores["payroll_taxes"] > 0.5


def test_phrase_split_on_punctuation_and_coordination() -> None:
    """Descriptions split into phrases at punctuation and "and"/"or"; the name is last."""
    aid = RoutingAid("home_help", "Music, lists and reminders; lights or locks.")
    assert description_phrases(aid.name, aid.description) == [
        "Music", "lists", "reminders", "lights", "locks", "home help",
    ]


@settings(max_examples=200, deadline=None)
@given(name=st.text(min_size=1, max_size=30), description=st.text(max_size=300)
       | st.builds(lambda word, n: (word + ", ") * n, st.text(max_size=8),
                   st.integers(0, 5_000)))
def test_description_phrases_are_trimmed_and_never_empty(name: str, description: str) -> None:
    """Every phrase comes without surrounding whitespace, and none is empty but the
    name's (a name of symbols only has no words)."""
    phrases = description_phrases(name, description)
    assert all(phrase == phrase.strip() for phrase in phrases)
    assert all(phrases[:-1])


def test_candidate_sets_share_the_model_of_their_described_routes() -> None:
    """Candidate sets that score the same routes from descriptions share one model."""
    chat = RoutingAid("chat", "Jokes and trivia.")
    service = LexicalDecisions({route: texts * 12 for route, texts in EXAMPLES.items()})
    for aids in ((*AIDS, chat), (AIDS[0], chat), (AIDS[1], chat)):
        service.score(request("tell me a joke", aids))
    stats = service.cache_stats()
    assert (stats["candidate_sets"], stats["description_models"]) == (3, 1)


def test_description_models_are_cached_per_candidate_set() -> None:
    """The same candidate set reuses one cached model; the cache is bounded."""
    service = LexicalDecisions(description_cache_size=2)
    service.score(request("rain"))
    service.score(request("song"))
    assert service.cache_stats()["description_models"] == 1
    service.score(request("song", AIDS[:2]))
    service.score(request("song", AIDS[1:]))
    stats = service.cache_stats()
    assert (stats["description_models"], stats["description_model_evictions"]) == (2, 1)


@pytest.mark.parametrize("knn_routes", [1, 2, 3])
def test_knn_routes_keeps_the_best_route_and_scores_every_candidate(knn_routes: int) -> None:
    """Restricting the kNN part to the closest routes still picks the matching one."""
    service = LexicalDecisions(EXAMPLES, knn_routes=knn_routes, max_document_frequency=1.0)
    decision = service.score(request("skip this song please"))
    assert decision.choice == "music"
    assert set(decision.scores) == {"weather", "music", "banking"}
    assert decision.scores["music"] == max(decision.scores.values())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_example_score": 1.5}, "min_example_score"),
        ({"min_description_score": -0.1}, "min_description_score"),
        ({"min_margin": "x"}, "min_margin"),
        ({"phrase_weight": 1.5}, "phrase_weight"),
        ({"epochs": 0}, "epochs"),
        ({"knn_budget": 0}, "knn_budget"),
        ({"max_query_chars": 0}, "max_query_chars"),
        ({"max_query_words": -1}, "max_query_words"),
        ({"example_calibration": (1.0, 2.0)}, "example_calibration"),
        ({"few_shot_calibration": "x"}, "few_shot_calibration"),
        ({"description_calibration": 3}, "description_calibration"),
        ({"neighbors": 0}, "neighbors"),
        ({"knn_routes": 0}, "knn_routes"),
        ({"knn_routes": 1.5}, "knn_routes"),
        ({"max_document_frequency": True}, "max_document_frequency"),
        ({"char_ngrams": (5, 3)}, "char_ngrams"),
        ({"description_cache_size": 0}, "description_cache_size"),
    ],
)
def test_invalid_arguments_raise_configuration_error_naming_them(
    kwargs: dict[str, object], name: str
) -> None:
    """Each invalid knob raises ConfigurationError naming the argument."""
    with pytest.raises(ConfigurationError, match=name):
        LexicalDecisions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "examples",
    [{"weather": "just a string"}, {"weather": ["ok", 3]}, {"": ["x"]}],
)
def test_invalid_examples_raise_configuration_error(examples: object) -> None:
    """Malformed examples raise ConfigurationError naming examples."""
    with pytest.raises(ConfigurationError, match="examples"):
        LexicalDecisions(examples)  # type: ignore[arg-type]


SERVICE = LexicalDecisions(EXAMPLES)
DESCRIBED = LexicalDecisions()


@settings(max_examples=200, deadline=None)
@given(
    query=st.text(max_size=80),
    subset=st.lists(st.sampled_from(AIDS), min_size=1, max_size=3, unique_by=lambda a: a.name),
)
def test_any_query_and_candidates_yield_a_candidate_or_clarify(
    query: str, subset: list[RoutingAid]
) -> None:
    """Whatever the text and candidate subset, the choice is a candidate or clarify; a
    clarify under the floor carries no scores, a choice every candidate's score."""
    for service in (SERVICE, DESCRIBED):
        decision = service.score(request(query, tuple(subset)))
        everything = service.score(request(query, tuple(subset)), keep_scores=True)
        assert decision.choice == everything.choice
        assert decision.choice in {a.name for a in subset} | {CLARIFY}
        assert set(everything.scores) == {a.name for a in subset}
        assert all(0.0 <= v <= 1.0 for v in everything.scores.values())
        assert decision.confidence == everything.confidence == max(everything.scores.values())
        if decision.choice == CLARIFY:
            assert all(v >= min(service.min_example_score, service.min_description_score)
                       for v in decision.scores.values())
        else:
            assert decision.scores == everything.scores


@settings(max_examples=150, deadline=None)
@given(
    query=st.one_of(
        st.text(max_size=2000),
        st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=50),
        st.binary(max_size=500).map(lambda b: b.decode("utf-8", "surrogateescape")),
        st.builds(lambda word, n: word * n, st.text(min_size=1, max_size=20),
                  st.integers(min_value=1, max_value=50_000)),
    ),
)
def test_junk_huge_and_surrogate_queries_never_raise(query: str) -> None:
    """Huge, junk and undecodable-byte queries answer a candidate or clarify (lone
    surrogates reach a decision service as U+FFFD: contracts refuse them as text)."""
    query = query.encode("utf-8", "replace").decode("utf-8")
    for service in (SERVICE, DESCRIBED):
        decision = service.score(request(query))
        assert decision.choice in {a.name for a in AIDS} | {CLARIFY}
        assert all(0.0 <= v <= 1.0 for v in decision.scores.values())


@pytest.mark.parametrize("service", [SERVICE, DESCRIBED], ids=["examples", "descriptions"])
def test_a_megabyte_query_is_scored_on_its_first_max_query_chars(
    service: LexicalDecisions,
) -> None:
    """Only the first max_query_chars characters of a query are read (bounded work)."""
    head = "will it rain this weekend " * 38
    huge = head[:1000] + "play some jazz music " * 50_000
    assert len(huge) > 1_000_000
    assert service.score(request(huge)).scores == service.score(request(head[:1000])).scores


def test_words_beyond_max_query_words_are_ignored() -> None:
    """A query is cut to max_query_words words."""
    service = LexicalDecisions(EXAMPLES, max_query_words=4)
    assert (service.score(request("will it rain tomorrow play some jazz music")).scores
            == service.score(request("will it rain tomorrow")).scores)


def test_confidence_is_the_calibrated_score_of_the_choice() -> None:
    """confidence equals the chosen route's score, which the calibration maps from signals."""
    decision = SERVICE.score(request("will it rain tomorrow"))
    assert decision.choice == "weather"
    assert decision.confidence == decision.scores["weather"]
    flat = LexicalCalibration((0.0, 0.0, 0.0, 0.0, 0.0), 0.0)
    neutral = LexicalDecisions(EXAMPLES, few_shot_calibration=flat, min_example_score=0.0)
    assert set(neutral.score(request("will it rain tomorrow")).scores.values()) == {0.5}


def test_few_shot_calibration_applies_to_small_example_sets_only() -> None:
    """Routes averaging fewer than 50 examples use few_shot_calibration, larger sets do not."""
    high = LexicalCalibration((0.0, 0.0, 0.0, 0.0, 0.0), 3.0)
    low = LexicalCalibration((0.0, 0.0, 0.0, 0.0, 0.0), -3.0)
    small = LexicalDecisions(EXAMPLES, few_shot_calibration=high, example_calibration=low)
    assert small.score(request("rain")).confidence == pytest.approx(0.9526, abs=1e-4)
    many = {route: texts * 20 for route, texts in EXAMPLES.items()}
    large = LexicalDecisions(many, few_shot_calibration=high, example_calibration=low)
    assert large.score(request("rain")).confidence == pytest.approx(0.0474, abs=1e-4)
    assert large.score(request("rain")).choice == CLARIFY


def test_floors_are_exposed_and_default_to_the_swept_values() -> None:
    """The clarify floors are readable, so an operator can see the threshold in force."""
    service = LexicalDecisions(min_example_score=0.7, min_description_score=0.2)
    assert (service.min_example_score, service.min_description_score) == (0.7, 0.2)


@pytest.mark.parametrize(
    "kwargs",
    [{"weights": (1.0, 2.0), "bias": 0.0}, {"weights": (1.0, 1.0, 1.0, 1.0, float("nan")),
                                            "bias": 0.0},
     {"weights": (0.0,) * 5, "bias": float("inf")}, {"weights": (0.0,) * 5, "bias": True},
     {"weights": (10**400,) + (0.0,) * 4, "bias": 0.0}, {"weights": (0.0,) * 5, "bias": 10**400}],
)
def test_invalid_calibration_raises_configuration_error(kwargs: dict[str, object]) -> None:
    """A calibration needs five finite weights and a finite bias."""
    with pytest.raises(ConfigurationError, match="LexicalCalibration"):
        LexicalCalibration(**kwargs)  # type: ignore[arg-type]


def test_calibration_confidence_is_a_stable_logistic() -> None:
    """confidence = sigmoid(bias + weights · signals), finite for extreme inputs."""
    calibration = LexicalCalibration((2.0, 0.0, 0.0, 0.0, -1.0), 0.5)
    assert calibration.confidence((1.0, 9.0, 9.0, 9.0, 0.5)) == pytest.approx(
        1 / (1 + math.exp(-2.0)))
    assert calibration.confidence((1e6, 0.0, 0.0, 0.0, 0.0)) == 1.0
    assert calibration.confidence((-1e6, 0.0, 0.0, 0.0, 0.0)) == 0.0


def test_caches_are_bounded_and_count_evictions() -> None:
    """Unseen query words and description models are cached up to a bound, evictions counted."""
    service = LexicalDecisions(EXAMPLES, description_cache_size=1)
    for number in range(4200):
        service.score(request(f"zq{number}x rain", (*AIDS, RoutingAid("other", f"d{number}"))))
    stats = service.cache_stats()
    assert stats["query_words"] == 4096
    assert stats["query_word_evictions"] == 4200 - 4096
    assert stats["query_word_hits"] <= 4096
    assert (stats["candidate_sets"], stats["candidate_set_evictions"]) == (1, 4199)
    assert stats["description_models"] == 1
    assert stats["description_model_evictions"] == 4199


def test_description_word_cache_is_bounded_across_models_and_counts_evictions() -> None:
    """Query words scored from descriptions are cached (summed once per word and model),
    at most 4,096 in all across the service's description models, evictions counted,
    and a cached word scores exactly as it did when it was first seen."""
    service = LexicalDecisions()
    first = request("weather zqfirstx", AIDS)
    before = dict(service.score(first).scores)
    for number in range(5000):
        aids = (*AIDS, RoutingAid("other", f"d{number % 3}"))
        service.score(request(f"zq{number}x", aids))
    stats = service.cache_stats()
    assert stats["description_models"] == 4
    assert stats["description_words"] == 4096
    assert stats["description_word_evictions"] == 2 + 5000 - 4096
    again = LexicalDecisions()
    again.score(first)  # fills the cache
    assert dict(again.score(first).scores) == before


def _tracked_from(root: object) -> int:
    """How many objects the garbage collector tracks among those reachable from `root`
    (not through classes, modules or functions), after two full collections: the
    collector untracks a tuple or dict of untracked contents in a pass, one level of
    nesting at a time. Counted by reachability, so other threads' objects do not count."""
    gc.collect()
    gc.collect()
    opaque = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType)
    seen = {id(root)}
    stack = [root]
    tracked = 0
    while stack:
        found = stack.pop()
        tracked += gc.is_tracked(found)
        for referent in gc.get_referents(found):
            if id(referent) not in seen and not isinstance(referent, opaque):
                seen.add(id(referent))
                stack.append(referent)
    return tracked


def test_example_model_keeps_few_objects_tracked_by_the_garbage_collector() -> None:
    """A service built from examples holds a few dozen objects the cyclic collector
    walks, however large its vocabulary, and decisions filling its caches of unseen
    words add none per word."""
    rng = random.Random(7)
    vocabulary = ["".join(rng.choices("abcdefghijklmnop", k=7)) for _ in range(3000)]
    large = {route: [" ".join(rng.sample(vocabulary, 6)) for _ in range(300)]
             for route in ("weather", "music", "banking")}
    small = LexicalDecisions(EXAMPLES)
    service = LexicalDecisions(large)
    few, many = _tracked_from(small), _tracked_from(service)
    assert few <= 40
    assert many <= few + 5  # ~30,000 features: the vocabulary adds nothing
    for number in range(600):
        service.score(request(f"{vocabulary[number]}q zq{number}x {vocabulary[-number]}"))
    assert service.cache_stats()["query_words"] >= 1200
    assert _tracked_from(service) <= many + 5


def test_example_model_packs_its_linear_rows() -> None:
    """Ten routes over a 3,000-word vocabulary take under 17 MB: every feature's row of
    per-route weights is packed doubles (20.9 MB when the rows were tuples of floats)."""
    rng = random.Random(7)
    vocabulary = ["".join(rng.choices("abcdefghijklmnop", k=7)) for _ in range(3000)]
    examples = {f"route{n}": [" ".join(rng.sample(vocabulary, 6)) for _ in range(100)]
                for n in range(10)}
    gc.collect()
    tracemalloc.start()
    try:
        service = LexicalDecisions(examples)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 17_000_000
    decision = service.score(request(examples["route3"][0],
                                     tuple(RoutingAid(name, "") for name in examples)))
    assert decision.choice == "route3"


def test_knn_budget_bounds_the_neighbour_walk_but_keeps_the_choice() -> None:
    """A one-entry kNN budget still ranks by the linear model and answers a candidate."""
    tight = LexicalDecisions(EXAMPLES, knn_budget=1, min_example_score=0.0)
    decision = tight.score(request("skip this song please"))
    assert decision.choice == "music"
    assert decision.scores == tight.score(request("skip this song please")).scores


def test_decision_scores_are_read_only() -> None:
    """The returned scores cannot be mutated by a caller (the service keeps no alias)."""
    decision = SERVICE.score(request("will it rain tomorrow"))
    with pytest.raises(TypeError):
        decision.scores["weather"] = 0.0  # type: ignore[index]


def _confidences(service: LexicalDecisions, query: RouteRequest) -> list[float]:
    """Each candidate's confidence recomputed from `signals` with the service's calibrations."""
    return [(service.example_calibration if backed else service.description_calibration)
            .confidence(values) for backed, values in service.signals(query)]


FEW_SHOT = LexicalDecisions(EXAMPLES)
MANY = LexicalDecisions({route: texts * 12 for route, texts in EXAMPLES.items()})


@settings(max_examples=120, deadline=None)
@given(
    query=st.text(alphabet=st.sampled_from("abcdefghijklmnoprstuwy '"), max_size=60)
    | st.sampled_from(["will it rain tomorrow", "skip this song please", "what is my balance",
                       "tell me about xylophones", "what is it", ""]),
    subset=st.lists(st.sampled_from((*AIDS, RoutingAid("chat", "Anything else."))),
                    min_size=1, max_size=4, unique_by=lambda a: a.name),
)
def test_scores_are_the_calibrated_signals(query: str, subset: list[RoutingAid]) -> None:
    """Every score is its calibration applied to what `signals` reports for it."""
    for service in (SERVICE, FEW_SHOT, MANY, DESCRIBED):
        turn = request(query, tuple(subset))
        signals = service.signals(turn)
        assert [backed for backed, _ in signals] == [
            aid.name in EXAMPLES and service is not DESCRIBED for aid in subset]
        assert all(math.isfinite(v) for _, values in signals for v in values)
        assert all(0.0 <= values[4] <= 1.0 for _, values in signals)
        assert list(service.score(turn, keep_scores=True).scores.values()) == pytest.approx(
            _confidences(service, turn), abs=1e-12)


def test_coverage_is_the_share_of_content_words_the_routes_know() -> None:
    """coverage counts content words found in examples or descriptions; only stopwords:
    all words count."""
    aids = (*AIDS[:2], RoutingAid("chat", "Jokes and trivia."))
    def coverage(query: str) -> float:
        return MANY.signals(request(query, aids))[0][1][4]
    assert coverage("will it rain tomorrow") == 1.0  # "will", "it": stopwords
    assert coverage("rain zzyzx") == 0.5
    assert coverage("tell me trivia") == 0.5  # "trivia" from chat's description
    assert coverage("what is it") == 1.0  # only stopwords: all count, all in examples
    assert coverage("would you") == 0.0  # only stopwords, none in the examples
    assert coverage("what is the weather") == 1.0
    assert coverage("") == 0.0


def test_unknown_words_lower_the_confidence_of_the_same_route() -> None:
    """A query padded with words no route knows keeps its route but loses confidence."""
    plain = MANY.score(request("will it rain tomorrow"), keep_scores=True)
    padded = MANY.score(request("will it rain tomorrow zzyzx qwoph"), keep_scores=True)
    assert max(plain.scores, key=plain.scores.__getitem__) == "weather"
    assert max(padded.scores, key=padded.scores.__getitem__) == "weather"
    assert padded.scores["weather"] < plain.scores["weather"]


def test_neighbour_signal_for_every_route_in_few_shot_and_the_best_one_otherwise() -> None:
    """Small example sets give every route its nearest-example signal; large ones only
    the best by linear score, unless knn_routes says otherwise."""
    query = request("play the weather music balance")
    def with_neighbors(service: LexicalDecisions) -> int:
        return sum(1 for _, values in service.signals(query) if values[1] > 0.0)
    assert with_neighbors(FEW_SHOT) == 3
    assert with_neighbors(MANY) == 1
    many = {route: texts * 12 for route, texts in EXAMPLES.items()}
    assert with_neighbors(LexicalDecisions(many, knn_routes=3)) == 3
    assert with_neighbors(LexicalDecisions(EXAMPLES, knn_routes=1)) == 1


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.none(), st.integers(-5, 50), st.floats(allow_nan=True),
                       st.booleans(), st.text(max_size=3), st.just(10**30)))
def test_knn_routes_accepts_none_or_a_positive_int_only(value: object) -> None:
    """knn_routes is None (the regime's default) or an int >= 1; anything else is refused
    naming it, and an accepted value still answers a candidate or clarify."""
    valid = value is None or (isinstance(value, int) and not isinstance(value, bool)
                              and value >= 1)
    if not valid:
        with pytest.raises(ConfigurationError, match="knn_routes"):
            LexicalDecisions(EXAMPLES, knn_routes=value)  # type: ignore[arg-type]
        return
    service = LexicalDecisions(EXAMPLES, knn_routes=value)  # type: ignore[arg-type]
    assert service.score(request("skip this song")).choice in {"music", CLARIFY}


def test_description_phrases_train_the_example_model() -> None:
    """descriptions= adds each described route's phrases to its examples: a query worded
    like a phrase but like no example reaches that route through the example model."""
    query = request("karaoke duets", AIDS[:2])
    plain = LexicalDecisions(EXAMPLES)
    taught = LexicalDecisions(EXAMPLES, descriptions={
        "weather": "Forecasts.", "music": "Songs, karaoke duets and albums."})
    def linear(service: LexicalDecisions) -> float:
        return service.signals(query)[1][1][0]
    assert linear(taught) > linear(plain)
    assert (taught.score(query, keep_scores=True).scores["music"]
            > plain.score(query, keep_scores=True).scores["music"])


def test_description_phrases_neither_add_routes_nor_change_the_regime() -> None:
    """A described route without examples stays description-scored, and phrases do not
    count as examples when choosing the few-shot calibration."""
    long = {"weather": ", ".join(f"topic {n}" for n in range(200)), "chat": "Anything."}
    service = LexicalDecisions(EXAMPLES, descriptions=long)
    short = LexicalDecisions(EXAMPLES, descriptions={"weather": "Forecasts."})
    assert service.example_calibration == short.example_calibration
    assert service.example_calibration != MANY.example_calibration
    aids = (*AIDS, RoutingAid("chat", "Anything."))
    assert [backed for backed, _ in service.signals(request("hello", aids))] == [
        True, True, True, False]


def test_few_shot_default_calibration_follows_whether_phrases_were_trained_on() -> None:
    """Few-shot services with and without description phrases get the default fitted
    for each; descriptions of routes without examples add no phrases."""
    plain = LexicalDecisions(EXAMPLES)
    described = LexicalDecisions(EXAMPLES, descriptions={"music": "Songs."})
    assert plain.example_calibration != described.example_calibration
    assert plain.min_example_score != described.min_example_score
    unrelated = LexicalDecisions(EXAMPLES, descriptions={"chat": "Anything."})
    assert unrelated.example_calibration == plain.example_calibration
    chosen = LexicalCalibration((1.0, 0.0, 0.0, 0.0, 0.0), 0.0)
    assert LexicalDecisions(EXAMPLES, few_shot_calibration=chosen).example_calibration == chosen


@pytest.mark.parametrize(
    "descriptions",
    ["weather", {"weather": 3}, {"": "x"}, {3: "x"}, [("weather", "x")]],
)
def test_invalid_descriptions_raise_configuration_error(descriptions: object) -> None:
    """descriptions must map route names to str; anything else is refused naming it."""
    with pytest.raises(ConfigurationError, match="descriptions"):
        LexicalDecisions(EXAMPLES, descriptions=descriptions)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(descriptions=st.one_of(
    st.dictionaries(st.text(max_size=12), st.text(max_size=300), max_size=5),
    st.dictionaries(st.sampled_from(sorted(EXAMPLES)),
                    st.builds(lambda part, n: part * n, st.text(min_size=1, max_size=8),
                              st.integers(1, 3000)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers() | st.none() | st.binary(max_size=4),
                    min_size=1, max_size=2),
))
def test_any_descriptions_build_a_service_or_raise_configuration_error(
    descriptions: dict[object, object],
) -> None:
    """Junk, huge and wrongly typed descriptions either build a working service or raise
    ConfigurationError naming descriptions: nothing else escapes."""
    valid = all(isinstance(key, str) and key and isinstance(value, str)
                for key, value in descriptions.items())
    if not valid:
        with pytest.raises(ConfigurationError, match="descriptions"):
            LexicalDecisions(EXAMPLES, descriptions=descriptions)  # type: ignore[arg-type]
        return
    service = LexicalDecisions(EXAMPLES, descriptions=descriptions)  # type: ignore[arg-type]
    decision = service.score(request("will it rain tomorrow"))
    assert decision.choice in {a.name for a in AIDS} | {CLARIFY}
    assert all(0.0 <= v <= 1.0 for v in decision.scores.values())


def test_examples_for_more_routes_than_a_model_holds_raise_configuration_error() -> None:
    """Examples for 4,097 routes raise ConfigurationError naming the bound (4,096 routes:
    every feature keeps a weight per route); 300 routes build and decide."""
    too_many = {f"route{i}": [f"word{i} thing"] for i in range(4097)}
    with pytest.raises(ConfigurationError, match="more than 4096 routes"):
        LexicalDecisions(too_many)
    many = {f"route{i}": [f"word{i} thing", f"other{i} stuff"] for i in range(300)}
    service = LexicalDecisions(many)
    aids = tuple(RoutingAid(name, f"{name} things") for name in list(many)[:11])
    turn = AgentTurn(participant_id="p", turn_id="t", query="word3 thing")
    assert service.score(RouteRequest(turn=turn, candidates=aids)).choice == "route3"


@pytest.mark.parametrize(("word", "extra"), [("alpha ", 0), ("alpha ", 3), ("billing, ", 5)])
def test_a_description_past_the_read_bound_still_decides(word: str, extra: int) -> None:
    """A description longer than the 1,000,000 characters a description model reads (a
    word cut at the bound, phrases running past it) decides like a short one: the
    phrases are weighed with the same IDF as the whole text, unseen parts as unseen."""
    size = 1_000_000 + extra
    description = (word * (size // len(word) + 1))[:size]
    decisions = LexicalDecisions(fallback_route="conversation")
    request = RouteRequest(AgentTurn("p", "t", f"{word.strip(' ,')} please"),
                           (RoutingAid("long", description), RoutingAid("conversation", "chat")))
    decision = decisions.score(request)
    assert decision.choice == "long"


def test_a_router_warns_of_example_routes_it_does_not_have(
        caplog: pytest.LogCaptureFixture) -> None:
    """An example key naming no registered destination (a typo: `"conversaton"`) is a
    WARNING at the router's construction naming it: that route silently had no examples
    (voice17 F7). Keys that are destinations warn of nothing; `example_routes` lists
    the keys in order."""
    decisions = LexicalDecisions({"weather": ["will it rain"],
                                  "conversaton": ["how are you", "tell me a joke"]},
                                 fallback_route="conversation")
    assert decisions.example_routes == ("weather", "conversaton")
    agents = {"weather": ScriptedAgent("weather"),
              "conversation": ScriptedAgent("conversation")}
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        AgentRouter(agents, decisions)
    assert len(caplog.records) == 1 and "'conversaton'" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        AgentRouter(agents, LexicalDecisions({"weather": ["will it rain"]},
                                             fallback_route="conversation"))
    assert caplog.records == []
    assert LexicalDecisions().example_routes == ()
