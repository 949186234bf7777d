"""Choose `LexicalDecisions`' signals, calibrations and floors on CLINC150 training data only.

Every choice below sees only train.jsonl (15,000 in-scope utterances) and oos_train.jsonl
(100 out-of-scope queries); the validation split is never read. Per mode:

- examples: 5-fold cross-validation over train: a model is built from four folds and
  scores the fifth plus all of oos_train; the calibration (a logistic map of the raw
  signals to "this choice is right") is fitted on the pooled held-out decisions, with
  equal total weight on in-scope and out-of-scope queries, and the floor
  (`min_example_score`) is the one maximising the balanced score on the same pool;
- few-shot: ten examples per route drawn from train (seeds 0-9), plus the benchmark's
  descriptions (with and without their phrases as extra examples, `descriptions=`);
  each draw scores 3,000 other train utterances plus oos_train. The figure each
  variant is chosen by is leave-one-draw-out: calibration and floor fitted on the other
  draws, scored on the held-out one (mean and range over the draws);
- descriptions: no examples; scored on all of train plus oos_train under each of five
  description sets written in different styles (the benchmark's tuned descriptions and
  the four of `description_styles.py`); the figure is leave-one-style-out (calibration
  and floor fitted on four styles, scored on the fifth), for `phrase_weight` 0.3, 0 and
  0.6, so the choice must carry over to descriptions written another way.

Each mode compares variants (which signals the calibration weighs, and whether every
route or only the best by the linear score gets the neighbour signal), listed from the
cheapest to the dearest per decision, and takes the first one within `TOLERANCE` of the
best balanced score (a gain smaller than that is below the noise of 100 out-of-scope
queries and not worth the time). It prints every variant's figure, the data it saw, and
the values to paste into `_lexical.py` (DEFAULT_*_CALIBRATION, DEFAULT_*_FLOOR,
DEFAULT_*_KNN_ROUTES).

`--knobs` also compares, on the few-shot draws, other values of `neighbors`,
`char_ngrams`, `epochs` and `phrase_weight` (leave-one-draw-out; a value replaces the
default only if its mean gains more than `TOLERANCE` and its worst draw is no worse).

Usage: PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/sweep_decisions.py [--data DIR]
       [--folds 5] [--modes examples,few-shot,descriptions,small-apps] [--draws 10] [--knobs]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from bench_decisions import DEFAULT_DATA, DESCRIPTIONS, few_shot_examples, require_data
from description_styles import STYLES

from turnrouter import AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import SIGNALS, LexicalCalibration, LexicalDecisions, fit_calibration

PROBE = LexicalCalibration((1.0, 1.0, 1.0, 1.0, 1.0), 0.0)
"""Non-zero weights, so the service computes every signal while the sweep collects them."""

Decision = tuple[int, list[tuple[bool, tuple[float, ...]]]]
"""(gold candidate position or -1 for out-of-scope, per-candidate signals)."""

Variant = tuple[str, tuple[bool, bool, bool, bool, bool], bool]
"""(label, signals weighed, neighbour signal for the linear-top route only)."""

TOLERANCE = 0.002
"""A dearer variant must beat the first one within this much of the best to be taken."""


def _load(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _collect(service: LexicalDecisions, aids: tuple[RoutingAid, ...],
             rows: Sequence[dict[str, str]]) -> list[Decision]:
    names = [aid.name for aid in aids]
    out: list[Decision] = []
    for row in rows:
        request = RouteRequest(AgentTurn("sweep", "t", row["text"]), aids)
        gold = names.index(row["domain"]) if row["domain"] in names else -1
        out.append((gold, [(backed, tuple(values))
                           for backed, values in service.signals(request)]))
    return out


def _linear_top(decision: Decision) -> int:
    """The candidate ranked first by the linear score (else the description score)."""
    signals = decision[1]
    return max(range(len(signals)), key=lambda i: (signals[i][1][0], signals[i][1][2]))


def _top_only(decisions: Sequence[Decision]) -> list[Decision]:
    """The same decisions with the neighbour signal kept for the linear-top route only
    (what `knn_routes=1` computes)."""
    out: list[Decision] = []
    for decision in decisions:
        top = _linear_top(decision)
        out.append((decision[0], [
            (backed, values if i == top else (values[0], 0.0, *values[2:]))
            for i, (backed, values) in enumerate(decision[1])]))
    return out


def _fit(decisions: Sequence[Decision], use: Sequence[bool]) -> LexicalCalibration:
    """The calibration fitted on each decision's linear-top candidate."""
    inside = sum(gold >= 0 for gold, _ in decisions)
    outside = len(decisions) - inside
    rows, right, weights = [], [], []
    for decision in decisions:
        gold = decision[0]
        top = _linear_top(decision)
        rows.append(decision[1][top][1])
        right.append(gold == top)
        weights.append(0.5 / inside if gold >= 0 else 0.5 / outside)
    return fit_calibration(rows, right, weights, use=use)


Outcome = tuple[bool, bool, float]
"""(in scope?, best candidate right?, its confidence)."""


def _outcomes(decisions: Sequence[Decision], calibration: LexicalCalibration
              ) -> list[Outcome]:
    """Each decision's best candidate under `calibration`: computed once per fit, so
    the floor search below is a cheap pass per floor."""
    out: list[Outcome] = []
    for gold, signals in decisions:
        confidences = [calibration.confidence(s) for _, s in signals]
        best = max(range(len(confidences)), key=confidences.__getitem__)
        out.append((gold >= 0, best == gold, confidences[best]))
    return out


def _score(outcomes: Sequence[Outcome], floor: float) -> tuple[float, float, float]:
    """Balanced score, in-scope accuracy and out-of-scope recall at `floor`."""
    correct = inside = clarified = outside = 0
    for in_scope, right, confidence in outcomes:
        if in_scope:
            inside += 1
            correct += right and confidence >= floor
        else:
            outside += 1
            clarified += confidence < floor
    accuracy, recall = correct / inside, clarified / outside
    return (accuracy + recall) / 2, accuracy, recall


def _balanced(decisions: Sequence[Decision], calibration: LexicalCalibration,
              floor: float) -> tuple[float, float, float]:
    return _score(_outcomes(decisions, calibration), floor)


def _floor(decisions: Sequence[Decision], calibration: LexicalCalibration) -> float:
    """The floor (0.025 steps) maximising the balanced score; ties go to the lower floor."""
    outcomes = _outcomes(decisions, calibration)
    best = max((_score(outcomes, step / 40)[0], -step) for step in range(1, 40))
    return -best[1] / 40


def _choose(mode: str, data: str, pools: Sequence[Sequence[Decision]],
            variants: Sequence[Variant], held_out: bool) -> float:
    """Fit every variant, print its figure and the chosen one's values; return its figure.

    `pools` are independent groups of decisions (few-shot draws); with `held_out`, a
    variant's figure is the mean over groups of the balanced score of the calibration
    and floor fitted on the other groups (else: fitted and scored on all of them).
    """
    print(f"{mode}: chosen on {data}")
    results: list[tuple[float, Variant, LexicalCalibration, float, tuple[float, ...]]] = []
    for variant in variants:
        label, use, top_only = variant
        groups = [_top_only(pool) if top_only else list(pool) for pool in pools]
        everything = [decision for group in groups for decision in group]
        calibration = _fit(everything, use)
        floor = _floor(everything, calibration)
        if held_out and len(groups) > 1:
            figures = _held_out(groups, use)
            figure = statistics.mean(figures)
            spread = tuple(figures)
        else:
            figure = _balanced(everything, calibration, floor)[0]
            spread = ()
        results.append((figure, variant, calibration, floor, spread))
        detail = ""
        if len(spread) > 5:
            detail = f" (per held-out draw {min(spread):.4f}-{max(spread):.4f})"
        elif spread:
            detail = " (per held-out group " + ", ".join(f"{v:.4f}" for v in spread) + ")"
        print(f"  {label:<52} balanced {figure:.4f}{detail}")
    best = max(r[0] for r in results)
    figure, (label, _, top_only), calibration, floor, _ = next(
        r for r in results if r[0] >= best - TOLERANCE)
    everything = [d for pool in pools for d in (_top_only(pool) if top_only else pool)]
    balanced, accuracy, recall = _balanced(everything, calibration, floor)
    print(f"  chosen: {label} (the first variant within {TOLERANCE} of the best, "
          f"{best:.4f})")
    print(f"  calibration = LexicalCalibration({calibration.weights!r}, {calibration.bias!r})"
          f"  (signals {', '.join(SIGNALS)})")
    print(f"  floor {floor:.3f}; knn_routes {'1' if top_only else 'all'}; fitted on all of "
          f"that data: balanced {balanced:.4f} (in-scope acc {accuracy:.4f}, oos recall "
          f"{recall:.4f}); at 0.50: {_balanced(everything, calibration, 0.5)[0]:.4f}")
    return figure


def _held_out(pools: Sequence[Sequence[Decision]], use: Sequence[bool]) -> list[float]:
    """Per group: the balanced score of the calibration and floor fitted on the others."""
    figures: list[float] = []
    for index, group in enumerate(pools):
        rest = [d for i, other in enumerate(pools) if i != index for d in other]
        calibration = _fit(rest, use)
        figures.append(_balanced(group, calibration, _floor(rest, calibration))[0])
    return figures


def _knobs(train: Sequence[dict[str, str]], domains: Sequence[str],
           described: tuple[RoutingAid, ...], oos_train: Sequence[dict[str, str]],
           count: int) -> None:
    """Few-shot: the chosen variant with other knob values, leave-one-draw-out.

    A knob value replaces the default only if its mean beats the default's by more
    than `TOLERANCE` and its worst held-out draw is no worse (robust, not lucky).
    """
    print("few-shot knobs (examples + description phrases, every route + coverage; the "
          "same draws, leave-one-draw-out):")
    knobs: list[tuple[str, dict[str, object]]] = [
        ("defaults (neighbors 3, char_ngrams (4, 4), epochs 4, phrase_weight 0.3)", {}),
        ("neighbors 1", {"neighbors": 1}), ("neighbors 2", {"neighbors": 2}),
        ("char_ngrams (3, 4)", {"char_ngrams": (3, 4)}),
        ("char_ngrams (3, 5)", {"char_ngrams": (3, 5)}),
        ("char_ngrams (5, 5)", {"char_ngrams": (5, 5)}),
        ("epochs 10", {"epochs": 10}), ("phrase_weight 0.5", {"phrase_weight": 0.5}),
    ]
    default: list[float] = []
    for label, knob in knobs:
        draws = []
        for seed in range(count):
            examples, rest = few_shot_examples(train, domains, seed=seed)
            service = LexicalDecisions(examples, descriptions=DESCRIPTIONS,
                                       few_shot_calibration=PROBE, knn_routes=len(domains),
                                       **knob)  # type: ignore[arg-type]
            draws.append(_collect(service, described, random.Random(seed).sample(rest, 3000))
                         + _collect(service, described, oos_train))
        figures = _held_out(draws, (True, True, True, True, True))
        default = default or figures
        taken = (statistics.mean(figures) > statistics.mean(default) + TOLERANCE
                 and min(figures) >= min(default))
        print(f"  {label:<72} balanced {statistics.mean(figures):.4f} (per held-out draw "
              f"{min(figures):.4f}-{max(figures):.4f}){'  -> better' if taken else ''}")


def _small_apps(train: Sequence[dict[str, str]], domains: Sequence[str],
                oos_train: Sequence[dict[str, str]]) -> None:
    """Few-shot without `descriptions=` (what an application written from the quickstart
    builds): apps of 3, 5 and 10 routes drawn from the domains, 5 or 10 examples each,
    routing aids described in no words, one-liners or keyword lists. Each app scores 300
    other train utterances of its domains and, as out-of-scope, 200 of the other domains
    plus oos_train. Figure: leave-one-app-shape-out (calibration and floor fitted on the
    other (routes, examples) shapes)."""
    from description_styles import KEYWORDS, ONE_LINER

    texts: list[dict[str, str]] = [{}, ONE_LINER, KEYWORDS]
    groups: dict[tuple[int, int], list[Decision]] = {}
    for routes in (3, 5, 10):
        for shots in (5, 10):
            pool: list[Decision] = []
            for seed in range(3):
                rng = random.Random(1000 * routes + 100 * shots + seed)
                chosen = rng.sample(list(domains), routes)
                examples = {d: [r["text"] for r in rng.sample(
                    [r for r in train if r["domain"] == d], shots)] for d in chosen}
                used = {text for texts_ in examples.values() for text in texts_}
                service = LexicalDecisions(examples, few_shot_calibration=PROBE,
                                           knn_routes=routes)
                aids = tuple(RoutingAid(d, texts[seed].get(d, "")) for d in chosen)
                inside = rng.sample([r for r in train if r["domain"] in chosen
                                     and r["text"] not in used], 300)
                others = [r for r in train if r["domain"] not in chosen]
                outside = [*(rng.sample(others, 200) if others else []), *oos_train]
                pool += _collect(service, aids, inside) + _collect(service, aids, outside)
            groups[(routes, shots)] = pool
    _choose("few-shot without descriptions=, small apps",
            "apps of 3/5/10 routes x 5/10 train examples (3 draws each, aids described in "
            "no words, one-liners or keywords), each scoring 300 other train utterances "
            "of its domains + 200 of the others and oos_train; figure: "
            "leave-one-app-shape-out", list(groups.values()), [
                ("linear + neighbors + description + lead (every route) + coverage",
                 (True, True, True, True, True), False)], held_out=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three sweeps and print the chosen values with the data they saw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=10, help="few-shot draws (seeds 0..)")
    parser.add_argument("--modes", default="examples,few-shot,descriptions")
    parser.add_argument("--max-document-frequency", type=float, default=0.002,
                        help="nearest-example index cut-off (examples mode)")
    parser.add_argument("--knobs", action="store_true",
                        help="few-shot: also compare neighbors, char_ngrams, epochs and "
                             "phrase_weight (the chosen variant, leave-one-draw-out)")
    args = parser.parse_args(argv)
    data = require_data(args.data)
    modes = set(args.modes.split(","))
    domains = list(json.loads((data / "domains.json").read_text(encoding="utf-8")))
    train = _load(data / "train.jsonl")
    oos_train = _load(data / "oos_train.jsonl")
    bare = tuple(RoutingAid(domain, "") for domain in domains)
    described = tuple(RoutingAid(domain, DESCRIPTIONS[domain]) for domain in domains)
    print("validation split: not read by this script")

    if "examples" in modes:
        start = time.perf_counter()
        order = list(range(len(train)))
        random.Random(1).shuffle(order)
        folds: int = args.folds
        pooled: list[Decision] = []
        for fold in range(folds):
            held = set(order[fold::folds])
            examples: dict[str, list[str]] = {domain: [] for domain in domains}
            for i, row in enumerate(train):
                if i not in held:
                    examples[row["domain"]].append(row["text"])
            service = LexicalDecisions(examples, knn_routes=len(domains),
                                       max_document_frequency=args.max_document_frequency)
            pooled += _collect(service, bare, [train[i] for i in sorted(held)])
            pooled += _collect(service, bare, oos_train)
        _choose("examples", f"{folds}-fold CV over train ({len(train)}) + oos_train "
                f"({len(oos_train)}) scored by every fold", [pooled], [
                    ("linear + neighbors (linear-top route)", (True, True, False, False, False),
                     True),
                    ("linear + neighbors (linear-top route) + coverage",
                     (True, True, False, False, True), True),
                    ("linear + neighbors (every route)", (True, True, False, False, False),
                     False),
                    ("linear + neighbors (every route) + coverage",
                     (True, True, False, False, True), False),
                ], held_out=False)
        print(f"  ({time.perf_counter() - start:.0f} s)")

    if "few-shot" in modes:
        everything_on = (True, True, True, True, True)
        chosen: list[tuple[float, str]] = []
        for source, descriptions in (("examples only", None),
                                     ("examples + description phrases", DESCRIPTIONS)):
            draws = []
            for seed in range(args.draws):
                examples, rest = few_shot_examples(train, domains, seed=seed)
                service = LexicalDecisions(examples, descriptions=descriptions,
                                           few_shot_calibration=PROBE, knn_routes=len(domains))
                draws.append(_collect(service, described,
                                      random.Random(seed).sample(rest, 3000))
                             + _collect(service, described, oos_train))
            figure = _choose(
                f"few-shot, {source}", f"10 examples per route from train (seeds "
                f"0-{args.draws - 1}), each scoring 3,000 other train utterances + "
                "oos_train; figure: leave-one-draw-out", draws, [
                    ("linear + neighbors + description + lead (linear-top route)",
                     (True, True, True, True, False), True),
                    ("... (linear-top route) + coverage", everything_on, True),
                    ("linear + neighbors + description + lead (every route)",
                     (True, True, True, True, False), False),
                    ("... (every route) + coverage", everything_on, False),
                ], held_out=True)
            chosen.append((figure, source))
        best = max(figure for figure, _ in chosen)
        print(f"few-shot: chosen {next(s for f, s in chosen if f >= best - TOLERANCE)} "
              f"(the first within {TOLERANCE} of the best, {best:.4f})")

    if "few-shot" in modes and args.knobs:
        _knobs(train, domains, described, oos_train, args.draws)

    if "small-apps" in modes:
        _small_apps(train, domains, oos_train)

    if "descriptions" in modes:
        # One pool per writing style (the benchmark's tuned descriptions and the four of
        # description_styles.py), each scoring all of train + oos_train: the figure of a
        # variant is leave-one-style-out (calibration and floor fitted on the other
        # styles, scored on the held-out one), so what is chosen must carry over to
        # descriptions written in a way it never saw.
        styles = {"tuned": DESCRIPTIONS, **STYLES}
        variants: list[Variant] = [
            ("description + lead", (False, False, True, True, False), False),
            ("description + lead + coverage", (False, False, True, True, True), False),
        ]
        best_figure, best_weight = -1.0, 0.3
        for phrase_weight in (0.3, 0.0, 0.6):
            service = LexicalDecisions(description_calibration=PROBE,
                                       phrase_weight=phrase_weight)
            pools = []
            for texts in styles.values():
                aids = tuple(RoutingAid(domain, texts[domain]) for domain in domains)
                pools.append(_collect(service, aids, train) + _collect(service, aids, oos_train))
            figure = _choose(
                f"descriptions, phrase_weight {phrase_weight}",
                f"train ({len(train)}) + oos_train ({len(oos_train)}) under each of "
                f"{len(styles)} description styles ({', '.join(styles)}); figure: "
                "leave-one-style-out", pools, variants, held_out=True)
            if figure > best_figure + TOLERANCE:
                best_figure, best_weight = figure, phrase_weight
        print(f"descriptions: phrase_weight {best_weight} (the default 0.3 unless another "
              f"beats it by more than {TOLERANCE}; {best_figure:.4f})")


if __name__ == "__main__":
    main()
