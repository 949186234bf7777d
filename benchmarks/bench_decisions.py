"""Routing quality, calibration and latency of `LexicalDecisions` on CLINC150.

Three modes, all reported on the validation split (val.jsonl: 3,000 in-scope, and
oos_val.jsonl: 100 out-of-scope queries), which nothing was tuned on:
- examples: fit on all train.jsonl utterances per domain;
- descriptions: no examples, only the domain descriptions below (`tuned`, revised from
  training-set misroutes) and, per writing style, those of `description_styles.py`
  (keywords, one-liner, prose, second person: how well description routing
  generalises to descriptions written another way);
- few-shot: ten train utterances per domain plus the descriptions (also passed as
  `descriptions=`, so their phrases train the example model), for several draws (seeds
  100-104 by default: none of them is a draw the sweep tuned on), reported as the mean
  with the range and standard deviation over the draws; the same without
  `descriptions=` for comparison.

Every parameter (calibrations, floors, neighbour routes) is the library default, chosen
by `benchmarks/sweep_decisions.py` on train + oos_train only; the table of which data
each choice saw is printed first. Balanced score = (in-scope accuracy, clarify counted
wrong, + out-of-scope clarify recall) / 2; top-1 = in-scope accuracy of the best-scored
route if nothing were ever clarified (the ceiling the floor trades against out-of-scope
recall).

Latency is per `score()` call: wall clock (median, p99) and the thread's CPU time (p99,
immune to the scheduler on a shared machine). The "11 candidates" rows add the demo's
description-only `conversation` route to the ten example-backed domains; the "demo
sample" row is the service `bench_scale.py` uses. Memory: the traced size of each
service after construction, and per decision the traced peak and what stays allocated
after 10,000 decisions (bounded caches); and how many objects the cyclic garbage
collector tracks that building each service adds (what every full collection walks:
at scale it is CPU per turn). The reliability tables bin the chosen
candidate's `confidence` on validation, with the 100 out-of-scope queries weighted to the
same total as the 3,000 in-scope ones (the balanced score's prior, the one the
calibration was fitted for).

Each mode also prints the figures "as routed": what reaches the participant when a
router asks the best usable score of a "clarify" (in-scope queries reaching their
domain, out-of-scope ones reaching a clarification), beside the same with every score
kept in a "clarify" (what routers saw before scores under the floor were dropped).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/bench_decisions.py [--data DIR]
       [--draws 5] [--first-seed 100]
`--data` defaults to benchmarks/data/clinc150 beside this file; the directory holds
domains.json, train.jsonl, val.jsonl, oos_train.jsonl and oos_val.jsonl (CLINC150,
Larson et al. 2019, CC BY 3.0; one {"text", "intent", "domain"} object per line).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from description_styles import STYLES

from turnrouter import CLARIFY, AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import LexicalDecisions
from turnrouter.demo import DESCRIPTIONS as DEMO_DESCRIPTIONS
from turnrouter.demo import load_sample

#: The CLINC150 splits shipped with the benchmarks (CC BY 3.0: data/clinc150/NOTICE.md);
#: `--data DIR` reads them from elsewhere.
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "clinc150"
DATA_FILES = ("domains.json", "train.jsonl", "val.jsonl", "oos_train.jsonl", "oos_val.jsonl")
CONVERSATION = RoutingAid("conversation", "General conversation for anything the other "
                          "destinations do not cover.")

DESCRIPTIONS: dict[str, str] = {
    "banking": (
        "Banking questions about my bank account: its balance, recent transactions and "
        "spending history (how much I spent last week or month, purchases and activity), "
        "transferring money, paying bills, what a bill is and when it is due, and the "
        "minimum payment. Also interest rates, routing numbers, ordering checks or "
        "checkbooks, changing a PIN, and reporting fraud or a frozen or blocked account."
    ),
    "credit_cards": (
        "Credit card help: my credit limit and raising it, my credit score and improving it, "
        "the APR, rewards points and redeeming them, applying for a new card and the "
        "application status, the card's expiration date, and replacing a card that was lost, "
        "stolen, damaged, declined or expired. Also international transaction fees when "
        "using a Visa or Amex card abroad."
    ),
    "kitchen_and_dining": (
        "Cooking and eating: recipes and how to make a dish, ingredients and what to use "
        "instead, cooking times, calories, nutrition and healthy food, how long food keeps in "
        "the fridge, and meal ideas for dinner. Also restaurant suggestions, reviews and "
        "ratings, how busy a restaurant is and the wait, whether it takes reservations, and "
        "booking, confirming or cancelling a table reservation."
    ),
    "home": (
        "Help around the house: playing music, what song is playing, skipping to the next "
        "song, playlists, shopping and to-do lists, reminders, calendar events and what is "
        "on my schedule, ordering things online and tracking an order or package, and "
        "controlling smart home devices like the lights, thermostat, fan, AC, TV or door."
    ),
    "auto_and_commute": (
        "Driving and getting around: directions and how to get somewhere, traffic, distance "
        "and how long it takes, the bus schedule, gas, the type of gas and fuel mileage "
        "(mpg), car maintenance such as oil changes, tire pressure, changing or replacing "
        "tires, the last and next service, engine lights and jump starting the car, "
        "booking an Uber ride, and my current location."
    ),
    "travel": (
        "Planning a trip: booking flights, hotels and rental cars, flight status, lost "
        "luggage and carry-on rules, visas, vaccines and shots, travel alerts, telling my "
        "bank I am going abroad, tourist suggestions of things to do, power plug and socket "
        "types or converters, currency exchange rates, the timezone, and how to say or "
        "translate something in French, Spanish or another language."
    ),
    "utility": (
        "Everyday tools: the weather forecast, the time and date, alarms and timers, a "
        "calculator for math, how many inches or minutes (unit conversions), word "
        "definitions, meanings and spelling, calling or texting someone, sending a text, "
        "finding my phone, sharing my location, flipping a coin or rolling dice."
    ),
    "work": (
        "My job: payday, paychecks, salary and income, direct deposit, W-2 forms and taxes, "
        "rolling over the 401k, health insurance benefits and changing them, paid time off "
        "(PTO) and vacation days: requesting them, the request status, days used and left, "
        "company holidays, and scheduling meetings."
    ),
    "small_talk": (
        "Casual chat with you, the assistant: hi, hello, goodbye and thank you, tell me a "
        "joke or something funny, fun facts, trivia and interesting things, the meaning of "
        "life, and getting to know you as an AI: your name, age, when you were born, where "
        "you are from, who made you, which company you work for, your hobbies and pets like "
        "dogs or cats, what I can ask you, and whether you are a real human or a bot."
    ),
    "meta": (
        "Controlling the assistant and the conversation: answering yes, no, maybe, true or "
        "false, cancelling or stopping, asking you to repeat or say that again, changing "
        "your name or what you call me, and changing your language, accent, voice (male or "
        "female), talking speed, volume or whisper mode. Also syncing or connecting my "
        "phone or device, and resetting to factory settings."
    ),
}


CHOSEN_ON = (
    ("examples", "calibration (linear, neighbors, coverage), floor, knn_routes=1: 5-fold "
     "CV over train (15,000) + oos_train (100) scored by every fold"),
    ("few-shot", "calibration (all five signals), floor, knn_routes=every route, "
     "descriptions= (their phrases as examples): ten examples per domain from train "
     "(seeds 0-9) + these descriptions, each draw scoring 3,000 other train utterances + "
     "oos_train; leave-one-draw-out"),
    ("descriptions", "calibration (description, lead), floor, phrase_weight: "
     "leave-one-style-out over five description styles (these descriptions, revised from "
     "training-set misroutes, and description_styles.py), each scoring train + oos_train"),
    ("all modes", "neighbors=3, char_ngrams=(4, 4), epochs=4, phrase_weight=0.3 compared "
     "on the few-shot training draws (sweep --knobs); max_document_frequency=0.002 by "
     "the examples CV (an earlier sweep)"),
)


def _load(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def require_data(data: Path) -> Path:
    """`data` if it holds the CLINC150 files, else exit naming what is missing."""
    missing = [name for name in DATA_FILES if not (data / name).is_file()]
    if missing:
        raise SystemExit(
            f"CLINC150 data not found in {data} (missing {', '.join(missing)}). Pass "
            f"--data DIR: a directory with {', '.join(DATA_FILES)}; the .jsonl files hold "
            'one {"text", "intent", "domain"} object per line ("oos" for out-of-scope) '
            "and domains.json maps each of the ten domains to its intents. Source: "
            "CLINC150 (Larson et al., EMNLP 2019, github.com/clinc/oos-eval, CC BY 3.0).")
    return data


def few_shot_examples(train: Sequence[dict[str, str]], domains: Sequence[str], *,
                      seed: int, shots: int = 10
                      ) -> tuple[dict[str, list[str]], list[dict[str, str]]]:
    """`shots` train utterances per domain (drawn with `seed`) and the remaining rows."""
    rng = random.Random(seed)
    chosen: set[int] = set()
    for domain in domains:
        rows = [i for i, row in enumerate(train) if row["domain"] == domain]
        chosen.update(rng.sample(rows, shots))
    examples: dict[str, list[str]] = {domain: [] for domain in domains}
    for i in sorted(chosen):
        examples[train[i]["domain"]].append(train[i]["text"])
    return examples, [row for i, row in enumerate(train) if i not in chosen]


Outcome = tuple[float, bool, bool]
"""Per query: (confidence, in scope?, chosen route right?)."""


def _evaluate(
    service: LexicalDecisions,
    aids: tuple[RoutingAid, ...],
    in_scope: Sequence[dict[str, str]],
    out_of_scope: Sequence[dict[str, str]],
) -> tuple[dict[str, float], list[Outcome]]:
    """Figures, and per query (confidence, in scope?, chosen route right?)."""
    timings: list[float] = []
    cpu: list[float] = []
    outcomes: list[Outcome] = []
    correct = clarified = 0
    routed = {True: 0, False: 0}
    """As a router goes on: in-scope queries reaching their domain, out-of-scope ones
    reaching a clarification (a "clarify" with usable scores asks the best of them)."""
    before = {True: 0, False: 0}
    """The same with every score kept in a "clarify" (what the router saw before
    `LexicalDecisions` dropped the scores under the floor)."""
    for rows, inside in ((in_scope, True), (out_of_scope, False)):
        for row in rows:
            request = RouteRequest(AgentTurn("bench", "t", row["text"]), aids)
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            decision = service.score(request)
            cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
            timings.append((time.perf_counter_ns() - start) / 1000.0)
            every = service.score(request, keep_scores=True).scores
            top = max(every, key=every.__getitem__)
            outcomes.append((decision.confidence or 0.0, inside, inside and top == row["domain"]))
            if inside:
                correct += decision.choice == row["domain"]
            else:
                clarified += decision.choice == CLARIFY
            for tally, scores in ((routed, decision.scores), (before, every)):
                goes = decision.choice
                if goes == CLARIFY and scores:
                    goes = max(scores, key=scores.__getitem__)
                tally[inside] += (goes == row["domain"]) if inside else (goes == CLARIFY)
    accuracy = correct / len(in_scope)
    recall = clarified / len(out_of_scope)
    timings.sort()
    cpu.sort()
    return {
        "balanced": (accuracy + recall) / 2,
        "in_scope_accuracy": accuracy,
        "oos_recall": recall,
        "top1": sum(right for _, _, right in outcomes) / len(in_scope),
        "routed_in_scope": routed[True] / len(in_scope),
        "routed_oos": routed[False] / len(out_of_scope),
        "before_in_scope": before[True] / len(in_scope),
        "before_oos": before[False] / len(out_of_scope),
        "median_us": statistics.median(timings),
        "p99_us": timings[int(0.99 * (len(timings) - 1))],
        "cpu_p99_us": cpu[int(0.99 * (len(cpu) - 1))],
    }, outcomes


def _latency(service: LexicalDecisions, aids: tuple[RoutingAid, ...],
             rows: Sequence[dict[str, str]], passes: int = 3) -> str:
    """Per decision over `rows`, `passes` times: median wall µs (and each pass's), p99
    wall µs, and the thread-CPU median and p99 (immune to the scheduler)."""
    requests = [RouteRequest(AgentTurn("bench", "t", row["text"]), aids) for row in rows]
    for request in requests[:200]:
        service.score(request)
    medians: list[float] = []
    timings: list[float] = []
    cpu: list[float] = []
    for _ in range(passes):
        walls: list[float] = []
        for request in requests:
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            service.score(request)
            cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
            walls.append((time.perf_counter_ns() - start) / 1000.0)
        medians.append(statistics.median(walls))
        timings += walls
    timings.sort()
    cpu.sort()
    last = len(timings) - 1
    return (f"median {statistics.median(timings):.1f} us (passes "
            + " / ".join(f"{m:.1f}" for m in medians)
            + f")  p99 {timings[int(0.99 * last)]:.1f} us; cpu median "
            f"{statistics.median(cpu):.1f} us, p99 {cpu[int(0.99 * last)]:.1f} us")


def _traced(build: Callable[[], LexicalDecisions]) -> tuple[LexicalDecisions, float]:
    """A service and its traced size in MB after construction."""
    tracemalloc.start()
    try:
        service = build()
        return service, tracemalloc.get_traced_memory()[0] / 1e6
    finally:
        tracemalloc.stop()


def _tracked(build: Callable[[], object]) -> tuple[int, int]:
    """How many more objects the cyclic garbage collector tracks (walks in every full
    collection) once a service is built: after one full collection and after a second
    (a pass untracks a tuple whose items are untracked, one level of nesting at a time)."""
    gc.collect()
    before = len(gc.get_objects())
    service = build()
    gc.collect()
    first = len(gc.get_objects()) - before
    gc.collect()
    second = len(gc.get_objects()) - before
    del service
    return first, second


def _allocations(service: LexicalDecisions, aids: tuple[RoutingAid, ...],
                 rows: Sequence[dict[str, str]]) -> tuple[float, float]:
    """Median traced peak (bytes) of one decision, and the KB still allocated after
    10,000 decisions over `rows` (what the bounded caches keep)."""
    requests = [RouteRequest(AgentTurn("bench", "t", row["text"]), aids) for row in rows]
    peaks: list[int] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for number in range(10_000):
            request = requests[number % len(requests)]
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            service.score(request)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
        kept = (tracemalloc.get_traced_memory()[0] - base) / 1000.0
    finally:
        tracemalloc.stop()
    return statistics.median(peaks), kept


def _reliability(outcomes: Sequence[Outcome], floor: float) -> list[str]:
    """Confidence bins: weighted share of queries, mean confidence, observed accuracy."""
    inside = sum(1 for _, i, _ in outcomes if i)
    outside = len(outcomes) - inside
    weight = {True: 0.5 / inside, False: 0.5 / outside}
    lines = ["  confidence  | share  | mean conf | right (top route correct) | n in / n oos"]
    for low in range(10):
        rows = [o for o in outcomes
                if low / 10 <= o[0] < (low + 1) / 10 or (low == 9 and o[0] == 1.0)]
        if not rows:
            continue
        total = sum(weight[i] for _, i, _ in rows)
        mean = sum(weight[i] * c for c, i, _ in rows) / total
        right = sum(weight[i] for _, i, r in rows if r) / total
        n_in = sum(1 for _, i, _ in rows if i)
        lines.append(f"  [{low / 10:.1f}, {(low + 1) / 10:.1f}) | {total:.3f}  | {mean:.3f}     "
                     f"| {right:.3f}                     | {n_in} / {len(rows) - n_in}")
    answered = [o for o in outcomes if o[0] >= floor]
    clarify_in = sum(1 for c, i, _ in outcomes if i and c < floor) / inside
    clarify_out = sum(1 for c, i, _ in outcomes if not i and c < floor) / outside
    lines.append(f"  clarification rate at the default floor {floor:.3f}: {clarify_in:.3f} of "
                 f"in-scope, {clarify_out:.3f} of out-of-scope queries "
                 f"({len(answered)} of {len(outcomes)} answered)")
    return lines


def _print(mode: str, figures: dict[str, float]) -> None:
    print(
        f"{mode:<22} balanced {figures['balanced']:.4f}  in-scope acc "
        f"{figures['in_scope_accuracy']:.4f}  oos recall {figures['oos_recall']:.4f}  "
        f"top-1 {figures['top1']:.4f}  median {figures['median_us']:.1f} us  "
        f"p99 {figures['p99_us']:.1f} us (cpu {figures['cpu_p99_us']:.1f})"
    )
    print(f"{'':<22} as routed: in-scope to their domain {figures['routed_in_scope']:.4f}, "
          f"out-of-scope to a clarification {figures['routed_oos']:.4f} (every score kept "
          f"in a clarify: {figures['before_in_scope']:.4f}, {figures['before_oos']:.4f})")


def _spread(label: str, draws: Sequence[dict[str, float]]) -> None:
    """Mean over draws, with the range and standard deviation of the balanced score."""
    mean = {key: statistics.mean(d[key] for d in draws) for key in draws[0]}
    _print(label, mean)
    balanced = [d["balanced"] for d in draws]
    deviation = statistics.stdev(balanced) if len(balanced) > 1 else 0.0
    print(f"{'':<22} balanced over {len(draws)} draws: min {min(balanced):.4f}  max "
          f"{max(balanced):.4f}  sd {deviation:.4f}  ("
          + ", ".join(f"{value:.4f}" for value in balanced) + ")")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three modes on the validation split and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--draws", type=int, default=5, help="few-shot draws")
    parser.add_argument("--first-seed", type=int, default=100,
                        help="seed of the first few-shot draw (the sweep tunes on 0-4)")
    args = parser.parse_args(argv)
    data = require_data(args.data)
    domains = list(json.loads((data / "domains.json").read_text(encoding="utf-8")))
    train = _load(data / "train.jsonl")
    val = _load(data / "val.jsonl")
    oos_val = _load(data / "oos_val.jsonl")

    examples: dict[str, list[str]] = {domain: [] for domain in domains}
    for row in train:
        examples[row["domain"]].append(row["text"])
    start = time.perf_counter()
    with_examples = LexicalDecisions(examples)
    build = time.perf_counter() - start
    bare = tuple(RoutingAid(domain, "") for domain in domains)
    described = tuple(RoutingAid(domain, DESCRIPTIONS[domain]) for domain in domains)
    descriptions_only = LexicalDecisions()

    print(f"CLINC150 validation: {len(val)} in-scope, {len(oos_val)} out-of-scope queries; "
          f"examples model built from {len(train)} utterances in {build:.2f} s")
    print("every parameter is a library default, chosen on training data only "
          "(benchmarks/sweep_decisions.py); validation is read only here:")
    for mode, chosen in CHOSEN_ON:
        print(f"  {mode}: {chosen}")
    outcomes: dict[str, tuple[list[Outcome], float]] = {}
    for mode, service, aids in (("examples", with_examples, bare),
                                ("descriptions", descriptions_only, described)):
        figures, found = _evaluate(service, aids, val, oos_val)
        _print(mode, figures)
        floor = (service.min_description_score if mode == "descriptions"
                 else service.min_example_score)
        outcomes[mode] = (found, floor)
    styled: dict[str, float] = {}
    for style, texts in STYLES.items():
        aids = tuple(RoutingAid(domain, texts[domain]) for domain in domains)
        figures, _ = _evaluate(descriptions_only, aids, val, oos_val)
        _print(f"descriptions, {style}", figures)
        styled[style] = figures["balanced"]
    print(f"descriptions over the {len(styled)} styles of description_styles.py: balanced "
          f"mean {statistics.mean(styled.values()):.4f}, lowest {min(styled.values()):.4f} "
          f"({min(styled, key=styled.__getitem__)})")
    seeds = range(args.first_seed, args.first_seed + args.draws)
    draws: list[dict[str, float]] = []
    pooled: list[Outcome] = []
    few_shot_floor = 0.0
    without: list[dict[str, float]] = []
    pooled_without: list[Outcome] = []
    plain_floor = 0.0
    for seed in seeds:
        shots, _ = few_shot_examples(train, domains, seed=seed)
        few_shot = LexicalDecisions(shots, descriptions=DESCRIPTIONS)
        few_shot_floor = few_shot.min_example_score
        figures, found = _evaluate(few_shot, described, val, oos_val)
        draws.append(figures)
        pooled += found
        plain = LexicalDecisions(shots)
        plain_floor = plain.min_example_score
        figures, found = _evaluate(plain, described, val, oos_val)
        without.append(figures)
        pooled_without += found
    _spread(f"few-shot (seeds {seeds[0]}-{seeds[-1]})", draws)
    _spread("  without descriptions=", without)
    outcomes[f"few-shot ({len(draws)} draws pooled)"] = (pooled, few_shot_floor)
    outcomes[f"few-shot without descriptions= ({len(draws)} draws pooled)"] = (
        pooled_without, plain_floor)
    figures, _ = _evaluate(LexicalDecisions(few_shot_examples(train, domains, seed=0)[0],
                                            descriptions=DESCRIPTIONS),
                           described, val, oos_val)
    _print("few-shot (seed 0)", figures)

    figures_11 = _latency(with_examples, (*bare, CONVERSATION), [*val, *oos_val])
    print(f"examples, 11 candidates (10 domains + conversation): {figures_11}")
    long_query = " ".join(row["text"] for row in val[:2000])
    figures_long = _latency(with_examples, (*bare, CONVERSATION),
                            [{"text": long_query}] * 250)
    print(f"examples, 11 candidates, a {len(long_query):,}-character query (capped): "
          f"{figures_long}")
    sample = load_sample()
    demo, demo_mb = _traced(lambda: LexicalDecisions(examples=sample.examples))
    demo_aids = tuple(RoutingAid(name, text) for name, text in DEMO_DESCRIPTIONS.items())
    demo_rows = [{"text": text} for text, _, _ in sample.queries]
    print(f"demo sample (75 examples per route, {len(demo_aids)} candidates, as in "
          f"bench_scale.py): {_latency(demo, demo_aids, demo_rows * 5)}")
    _, clinc_mb = _traced(lambda: LexicalDecisions(examples))
    peak, kept = _allocations(with_examples, (*bare, CONVERSATION), [*val, *oos_val])
    demo_peak, demo_kept = _allocations(demo, demo_aids, demo_rows)
    print(f"memory: CLINC150 examples service {clinc_mb:.1f} MB, demo service "
          f"{demo_mb:.1f} MB (traced, once per service, shared by every participant); "
          f"per decision: traced peak median {peak / 1000:.1f} KB (demo "
          f"{demo_peak / 1000:.1f} KB), kept after 10,000 decisions {kept:.0f} KB (demo "
          f"{demo_kept:.0f} KB)")
    clinc_gc, demo_gc = _tracked(lambda: LexicalDecisions(examples)), _tracked(
        lambda: LexicalDecisions(examples=sample.examples))
    print(f"garbage collector: objects it tracks added by building the CLINC150 examples "
          f"service {clinc_gc[0]:,} after one full collection, {clinc_gc[1]:,} after two; "
          f"the demo service {demo_gc[0]:,}, {demo_gc[1]:,}")
    for mode, (found, floor) in outcomes.items():
        print(f"reliability, {mode} (validation; oos weighted to half):")
        print("\n".join(_reliability(found, floor)))


if __name__ == "__main__":
    main()
