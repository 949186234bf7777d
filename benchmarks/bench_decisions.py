"""Routing quality and latency of `LexicalDecisions` on CLINC150 (10 domains + out-of-scope).

Two modes, both evaluated on the validation split (val.jsonl + oos_val.jsonl):
- examples: fit on train.jsonl utterances per domain, default thresholds;
- descriptions: no examples, only the one-sentence domain descriptions below.

Balanced score = (in-scope accuracy, clarify counted wrong + out-of-scope clarify recall) / 2.
`--sweep` also prints the thresholds that would maximise the balanced score on
val (in-scope) + oos_train, the data used to choose the library defaults.

Usage: .venv/bin/python benchmarks/bench_decisions.py [--data DIR] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from turnrouter import CLARIFY, AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import LexicalDecisions

DEFAULT_DATA = Path("/work/shared/data/clinc150")

DESCRIPTIONS: dict[str, str] = {
    "banking": (
        "Banking questions about my bank account: its balance, recent transactions and "
        "spending history, transferring money, paying bills, what a bill is and when it is "
        "due, and the minimum payment. Also interest rates, routing numbers, ordering "
        "checks, changing a PIN, and reporting fraud or a frozen or blocked account."
    ),
    "credit_cards": (
        "Credit card help: my credit limit and raising it, my credit score and improving it, "
        "the APR, rewards points and redeeming them, applying for a new card and the "
        "application status, the card's expiration date, and replacing a card that was lost, "
        "damaged, declined or expired. Also card fees when traveling abroad."
    ),
    "kitchen_and_dining": (
        "Cooking and eating: recipes, ingredients and substitutes, cooking times, calories "
        "and nutrition, how long food keeps, and meal ideas. Also restaurant suggestions and "
        "reviews, how busy a restaurant is, whether it takes reservations, and booking, "
        "confirming or cancelling a table reservation."
    ),
    "home": (
        "Help around the house: playing music, what song is playing, skipping to the next "
        "song, playlists, shopping and to-do lists, reminders, calendar events, ordering "
        "things online and tracking orders, and controlling smart home devices like the "
        "lights."
    ),
    "auto_and_commute": (
        "Driving and getting around: directions, traffic and distance, gas, the type of gas "
        "and fuel mileage, car maintenance such as oil changes, tire pressure, changing a "
        "tire, the last and next service, and jump starting the car, booking an Uber ride, "
        "and where I am right now."
    ),
    "travel": (
        "Planning a trip: booking flights, hotels and rental cars, flight status, lost "
        "luggage and carry-on rules, visas and vaccines, travel alerts, telling my bank I am "
        "traveling, travel suggestions, power plug types, currency exchange rates, time "
        "zones and translating into another language."
    ),
    "utility": (
        "Everyday tools: the weather forecast, the time and date, alarms and timers, a "
        "calculator for math and unit conversions, word definitions and spelling, calling or "
        "texting someone, finding my phone, sharing my location, flipping a coin or rolling "
        "dice."
    ),
    "work": (
        "My job: payday and paychecks, income, direct deposit, W-2 forms and taxes, rolling "
        "over the 401k, health insurance benefits and changing them, paid time off (PTO) and "
        "vacation days: requesting them, the request status, days used and left, company "
        "holidays, and scheduling meetings."
    ),
    "small_talk": (
        "Casual chat with you, the assistant: hi, hello, goodbye and thank you, jokes, fun "
        "facts and the meaning of life, and getting to know you: your name, how old you are, "
        "where you are from, who made you, who you work for, your hobbies and pets, what I "
        "can ask you, and whether you are a real person or a bot."
    ),
    "meta": (
        "Controlling the assistant and the conversation: answering yes, no or maybe, "
        "cancelling, asking you to repeat or say that again, changing your name or what you "
        "call me, and changing your language, accent, talking speed, volume or whisper mode. "
        "Also syncing a device and resetting to factory settings."
    ),
}


def _load(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _evaluate(
    service: LexicalDecisions,
    aids: tuple[RoutingAid, ...],
    in_scope: Sequence[dict[str, str]],
    out_of_scope: Sequence[dict[str, str]],
) -> dict[str, float]:
    """Balanced score, its two halves, and per-decision latency in microseconds."""
    timings: list[float] = []
    correct = 0
    for row in in_scope:
        request = RouteRequest(AgentTurn("bench", "t", row["text"]), aids)
        start = time.perf_counter_ns()
        decision = service.score(request)
        timings.append((time.perf_counter_ns() - start) / 1000.0)
        correct += decision.choice == row["domain"]
    clarified = 0
    for row in out_of_scope:
        request = RouteRequest(AgentTurn("bench", "t", row["text"]), aids)
        start = time.perf_counter_ns()
        decision = service.score(request)
        timings.append((time.perf_counter_ns() - start) / 1000.0)
        clarified += decision.choice == CLARIFY
    accuracy = correct / len(in_scope)
    recall = clarified / len(out_of_scope)
    timings.sort()
    return {
        "balanced": (accuracy + recall) / 2,
        "in_scope_accuracy": accuracy,
        "oos_recall": recall,
        "median_us": statistics.median(timings),
        "p95_us": timings[int(0.95 * (len(timings) - 1))],
    }


def _sweep(
    service: LexicalDecisions,
    aids: tuple[RoutingAid, ...],
    in_scope: Sequence[dict[str, str]],
    out_of_scope: Sequence[dict[str, str]],
) -> str:
    """Best (min score, min margin) on the given split, from the service's raw scores."""
    def top_two(text: str) -> tuple[str, float, float]:
        decision = service.score(RouteRequest(AgentTurn("bench", "t", text), aids))
        ranked = sorted(decision.scores.items(), key=lambda item: -item[1])
        return ranked[0][0], ranked[0][1], ranked[0][1] - ranked[1][1]

    inside = [(row["domain"], *top_two(row["text"])) for row in in_scope]
    outside = [top_two(row["text"]) for row in out_of_scope]
    best = (0.0, 0.0, 0.0)
    for score_step in range(0, 80):
        floor = score_step / 100
        for margin in (0.0, 0.01, 0.02, 0.03, 0.05, 0.08):
            accuracy = sum(g == r and s >= floor and m >= margin
                           for g, r, s, m in inside) / len(inside)
            recall = sum(s < floor or m < margin for _, s, m in outside) / len(outside)
            balanced = (accuracy + recall) / 2
            if balanced > best[0]:
                best = (balanced, floor, margin)
    return f"best balanced {best[0]:.4f} at min_score={best[1]:.2f} min_margin={best[2]:.2f}"


def _print(mode: str, figures: dict[str, float], extra: str = "") -> None:
    print(
        f"{mode:<13} balanced {figures['balanced']:.4f}  in-scope acc "
        f"{figures['in_scope_accuracy']:.4f}  oos recall {figures['oos_recall']:.4f}  "
        f"median {figures['median_us']:.1f} us  p95 {figures['p95_us']:.1f} us{extra}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run both modes on the validation split and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--sweep", action="store_true",
                        help="also print the best thresholds on val + oos_train")
    args = parser.parse_args(argv)
    data: Path = args.data
    domains = list(json.loads((data / "domains.json").read_text(encoding="utf-8")))
    train = _load(data / "train.jsonl")
    val = _load(data / "val.jsonl")
    oos_train = _load(data / "oos_train.jsonl")
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
    _print("examples", _evaluate(with_examples, bare, val, oos_val))
    _print("descriptions", _evaluate(descriptions_only, described, val, oos_val))
    if args.sweep:
        print("examples     ", _sweep(with_examples, bare, val, oos_train))
        print("descriptions ", _sweep(descriptions_only, described, val, oos_train))


if __name__ == "__main__":
    main()
