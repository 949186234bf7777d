"""Choose `LexicalDecisions`' calibrations and thresholds on CLINC150 training data only.

Every choice below sees only train.jsonl (15,000 in-scope utterances) and oos_train.jsonl
(100 out-of-scope queries); the validation split is never read. Per mode:

- examples: 5-fold cross-validation over train: a model is built from four folds and
  scores the fifth plus all of oos_train; the calibration (a logistic map of the raw
  signals to "this choice is right") is fitted on the pooled held-out decisions, with
  equal total weight on in-scope and out-of-scope queries, and the floor
  (`min_example_score`) is the one maximising the balanced score on the same pool;
- few-shot: ten examples per route drawn from train (three seeds), plus the benchmark's
  descriptions; scored on 3,000 other train utterances per seed plus oos_train;
- descriptions: no examples; scored on all of train plus oos_train (nothing is fitted to
  the utterances, so no folds are needed).

It prints the values to paste into `_lexical.py` (DEFAULT_*_CALIBRATION and
DEFAULT_*_FLOOR) and the balanced score each reaches on its own tuning data.
`--max-document-frequency 0.002 0.005 0.01` compares kNN index cut-offs by the same CV;
`--neighbors` changes the few-shot neighbour count.

Usage: PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/sweep_decisions.py [--data DIR]
       [--folds 5] [--modes examples,few-shot,descriptions]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

from bench_decisions import DEFAULT_DATA, DESCRIPTIONS, few_shot_examples

from turnrouter import AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import LexicalCalibration, LexicalDecisions
from turnrouter.decisions._calibration import SIGNALS, fit_calibration

PROBE = LexicalCalibration((1.0, 1.0, 1.0, 1.0, 1.0), 0.0)
"""Non-zero weights, so the service computes every signal while the sweep collects them."""

Decision = tuple[int, list[tuple[bool, tuple[float, ...]]]]
"""(gold candidate position or -1 for out-of-scope, per-candidate signals)."""


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
        out.append((gold, service._signals(request)))
    return out


def _top(decision: Decision) -> int:
    """The candidate ranked first by the linear score (else the description score)."""
    signals = decision[1]
    return max(range(len(signals)), key=lambda i: (signals[i][1][0], signals[i][1][3]))


def _fit(decisions: Sequence[Decision], use: Sequence[bool]) -> LexicalCalibration:
    inside = sum(gold >= 0 for gold, _ in decisions)
    outside = len(decisions) - inside
    rows, right, weights = [], [], []
    for decision in decisions:
        gold = decision[0]
        top = _top(decision)
        rows.append(decision[1][top][1])
        right.append(gold == top)
        weights.append(0.5 / inside if gold >= 0 else 0.5 / outside)
    return fit_calibration(rows, right, weights, use=use)


def _balanced(decisions: Sequence[Decision], calibration: LexicalCalibration,
              floor: float) -> tuple[float, float, float]:
    correct = inside = clarified = outside = 0
    for gold, signals in decisions:
        confidences = [calibration.confidence(s) for _, s in signals]
        best = max(range(len(confidences)), key=confidences.__getitem__)
        answered = confidences[best] >= floor
        if gold >= 0:
            inside += 1
            correct += answered and best == gold
        else:
            outside += 1
            clarified += not answered
    accuracy, recall = correct / inside, clarified / outside
    return (accuracy + recall) / 2, accuracy, recall


def _floor(decisions: Sequence[Decision], calibration: LexicalCalibration) -> float:
    """The floor (0.025 steps) maximising the balanced score; ties go to the lower floor."""
    best = max((_balanced(decisions, calibration, step / 40)[0], -step) for step in range(1, 40))
    return -best[1] / 40


def _report(mode: str, data: str, decisions: Sequence[Decision],
            calibration: LexicalCalibration) -> None:
    floor = _floor(decisions, calibration)
    balanced, accuracy, recall = _balanced(decisions, calibration, floor)
    print(f"{mode}: chosen on {data}")
    print(f"  calibration = LexicalCalibration({calibration.weights!r}, {calibration.bias!r})"
          f"  (signals {', '.join(SIGNALS)})")
    print(f"  floor {floor:.3f}: balanced {balanced:.4f} (in-scope acc {accuracy:.4f}, "
          f"oos recall {recall:.4f}) on that data; at 0.50: "
          f"{_balanced(decisions, calibration, 0.5)[0]:.4f}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three sweeps and print the chosen values with the data they saw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--modes", default="examples,few-shot,descriptions")
    parser.add_argument("--neighbors", type=int, default=3,
                        help="nearest examples averaged (few-shot mode)")
    parser.add_argument("--knn-routes", type=int, default=1,
                        help="routes given the neighbour signal (few-shot mode)")
    parser.add_argument("--max-document-frequency", type=float, nargs="*", default=[0.002],
                        help="kNN index cut-offs to compare (examples mode)")
    args = parser.parse_args(argv)
    data: Path = args.data
    modes = set(args.modes.split(","))
    domains = list(json.loads((data / "domains.json").read_text(encoding="utf-8")))
    train = _load(data / "train.jsonl")
    oos_train = _load(data / "oos_train.jsonl")
    bare = tuple(RoutingAid(domain, "") for domain in domains)
    described = tuple(RoutingAid(domain, DESCRIPTIONS[domain]) for domain in domains)
    print("validation split: not read by this script")

    if "examples" in modes:
        for max_df in args.max_document_frequency:
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
                service = LexicalDecisions(examples, example_calibration=PROBE,
                                           max_document_frequency=max_df)
                pooled += _collect(service, bare, [train[i] for i in sorted(held)])
                pooled += _collect(service, bare, oos_train)
            calibration = _fit(pooled, use=(True, True, True, False, False))
            _report(f"examples (max_document_frequency={max_df})",
                    f"{folds}-fold CV over train ({len(train)}) + oos_train "
                    f"({len(oos_train)}) scored by every fold", pooled, calibration)
            print(f"  ({time.perf_counter() - start:.0f} s)")

    if "few-shot" in modes:
        pooled = []
        for seed in range(3):
            examples, rest = few_shot_examples(train, domains, seed=seed)
            service = LexicalDecisions(examples, few_shot_calibration=PROBE,
                                       neighbors=args.neighbors, knn_routes=args.knn_routes)
            pooled += _collect(service, described, random.Random(seed).sample(rest, 3000))
            pooled += _collect(service, described, oos_train)
        calibration = _fit(pooled, use=(True, True, True, True, True))
        _report(f"few-shot (neighbors={args.neighbors}, knn_routes={args.knn_routes})",
                "10 examples per route from train (seeds 0-2), each scoring 3,000 other "
                "train utterances + oos_train", pooled, calibration)

    if "descriptions" in modes:
        service = LexicalDecisions()
        pooled = _collect(service, described, train) + _collect(service, described, oos_train)
        calibration = _fit(pooled, use=(False, False, False, True, True))
        _report("descriptions", f"train ({len(train)}) + oos_train ({len(oos_train)})",
                pooled, calibration)


if __name__ == "__main__":
    main()
