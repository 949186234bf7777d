"""Routing quality, calibration and latency of `LexicalDecisions` on CLINC150.

Three modes, all reported on the validation split (val.jsonl: 3,000 in-scope, and
oos_val.jsonl: 100 out-of-scope queries), which nothing was tuned on:
- examples: fit on all train.jsonl utterances per domain;
- descriptions: no examples, only the domain descriptions below;
- few-shot: ten train utterances per domain (seed 0) plus the descriptions.

Every parameter (calibrations, floors, margin) is the library default, chosen by
`benchmarks/sweep_decisions.py` on train + oos_train only (it prints which data each
choice saw). Balanced score = (in-scope accuracy, clarify counted wrong, + out-of-scope
clarify recall) / 2; top-1 = in-scope accuracy of the best-scored route if nothing were
ever clarified (the ceiling the floor trades against out-of-scope recall).

Latency is per `score()` call: wall clock (median, p99) and the thread's CPU time (p99,
immune to the scheduler on a shared machine). The "11 candidates" rows add the demo's
description-only `conversation` route to the ten example-backed domains; the "demo
sample" row is the service `bench_scale.py` uses. The reliability tables bin the chosen
candidate's `confidence` on validation, with the 100 out-of-scope queries weighted to the
same total as the 3,000 in-scope ones (the balanced score's prior, the one the
calibration was fitted for).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/bench_decisions.py [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from turnrouter import CLARIFY, AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import LexicalDecisions
from turnrouter.demo import DESCRIPTIONS as DEMO_DESCRIPTIONS
from turnrouter.demo import load_sample

DEFAULT_DATA = Path("/work/shared/data/clinc150")
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


def _load(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


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


def _evaluate(
    service: LexicalDecisions,
    aids: tuple[RoutingAid, ...],
    in_scope: Sequence[dict[str, str]],
    out_of_scope: Sequence[dict[str, str]],
) -> tuple[dict[str, float], list[tuple[float, bool, bool]]]:
    """Figures, and per query (confidence, in scope?, chosen route right?)."""
    timings: list[float] = []
    cpu: list[float] = []
    outcomes: list[tuple[float, bool, bool]] = []
    correct = clarified = 0
    for rows, inside in ((in_scope, True), (out_of_scope, False)):
        for row in rows:
            request = RouteRequest(AgentTurn("bench", "t", row["text"]), aids)
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            decision = service.score(request)
            cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
            timings.append((time.perf_counter_ns() - start) / 1000.0)
            top = max(decision.scores, key=decision.scores.__getitem__)
            outcomes.append((decision.confidence or 0.0, inside, inside and top == row["domain"]))
            if inside:
                correct += decision.choice == row["domain"]
            else:
                clarified += decision.choice == CLARIFY
    accuracy = correct / len(in_scope)
    recall = clarified / len(out_of_scope)
    timings.sort()
    cpu.sort()
    return {
        "balanced": (accuracy + recall) / 2,
        "in_scope_accuracy": accuracy,
        "oos_recall": recall,
        "top1": sum(right for _, _, right in outcomes) / len(in_scope),
        "median_us": statistics.median(timings),
        "p99_us": timings[int(0.99 * (len(timings) - 1))],
        "cpu_p99_us": cpu[int(0.99 * (len(cpu) - 1))],
    }, outcomes


def _latency(service: LexicalDecisions, aids: tuple[RoutingAid, ...],
             rows: Sequence[dict[str, str]]) -> tuple[float, float, float]:
    """Median and p99 wall µs, and p99 thread-CPU µs, per decision over `rows`."""
    timings: list[float] = []
    cpu: list[float] = []
    for row in rows:
        request = RouteRequest(AgentTurn("bench", "t", row["text"]), aids)
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        service.score(request)
        cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
        timings.append((time.perf_counter_ns() - start) / 1000.0)
    timings.sort()
    cpu.sort()
    last = len(timings) - 1
    return statistics.median(timings), timings[int(0.99 * last)], cpu[int(0.99 * last)]


def _reliability(outcomes: Sequence[tuple[float, bool, bool]], floor: float) -> list[str]:
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
        f"{mode:<13} balanced {figures['balanced']:.4f}  in-scope acc "
        f"{figures['in_scope_accuracy']:.4f}  oos recall {figures['oos_recall']:.4f}  "
        f"top-1 {figures['top1']:.4f}  median {figures['median_us']:.1f} us  "
        f"p99 {figures['p99_us']:.1f} us (cpu {figures['cpu_p99_us']:.1f})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three modes on the validation split and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    data: Path = args.data
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
    shots, _ = few_shot_examples(train, domains, seed=0)
    few_shot = LexicalDecisions(shots)
    descriptions_only = LexicalDecisions()

    print(f"CLINC150 validation: {len(val)} in-scope, {len(oos_val)} out-of-scope queries; "
          f"examples model built from {len(train)} utterances in {build:.2f} s")
    print("every parameter: library defaults, chosen on train + oos_train only "
          "(benchmarks/sweep_decisions.py); validation read only here")
    reliability: dict[str, list[str]] = {}
    for mode, service, aids in (("examples", with_examples, bare),
                                ("descriptions", descriptions_only, described),
                                ("few-shot", few_shot, described)):
        figures, outcomes = _evaluate(service, aids, val, oos_val)
        _print(mode, figures)
        floor = (service.min_description_score if mode == "descriptions"
                 else service.min_example_score)
        reliability[mode] = _reliability(outcomes, floor)
    median, p99, cpu = _latency(with_examples, (*bare, CONVERSATION), [*val, *oos_val])
    print(f"examples, 11 candidates (10 domains + conversation): median {median:.1f} us  "
          f"p99 {p99:.1f} us (cpu {cpu:.1f})")
    long_query = " ".join(row["text"] for row in val[:2000])
    median, p99, cpu = _latency(with_examples, (*bare, CONVERSATION),
                           [{"text": long_query}] * 50)
    print(f"examples, 11 candidates, a {len(long_query):,}-character query (capped): "
          f"median {median:.1f} us  p99 {p99:.1f} us (cpu {cpu:.1f})")
    sample = load_sample()
    demo = LexicalDecisions(examples=sample.examples)
    demo_aids = tuple(RoutingAid(name, text) for name, text in DEMO_DESCRIPTIONS.items())
    median, p99, cpu = _latency(demo, demo_aids,
                                [{"text": text} for text, _, _ in sample.queries] * 5)
    print(f"demo sample (75 examples per route, {len(demo_aids)} candidates, as in "
          f"bench_scale.py): median {median:.1f} us  p99 {p99:.1f} us (cpu {cpu:.1f})")
    for mode, lines in reliability.items():
        print(f"reliability, {mode} (validation; oos weighted to half):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
