"""Event-loop time of a NATS worker's claim of a big participant record, this tree beside
another (redteam18 F6, issue #30).

A claim parses a record over 64 KiB in a thread; what is left on the event loop is the
import. For each ~1 MB snapshot shape, within every documented bound, this prints the
milliseconds (best of `--repeats`) of: the baseline's import on the loop
(`import_participant` of the parsed snapshot), this tree's thread part
(`prepared_import`: validation, NaN check, read-back) and its loop part (the import of
what that returned).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_big_records.py --baseline ../main/src
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import time
from collections.abc import Callable
from typing import Any

from _trees import import_tree

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    ParticipantSnapshot,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from turnrouter._router import prepared_import

_STAMP = 1_700_000_000_000_000


def _patched(i: int, facts: dict[str, Any]) -> dict[str, Any]:
    patch = {"task_id": f"k{i}", "completed_at": "2026-01-01T00:00:00Z", "digest": ["d"],
             "facts": facts}
    return {"user": "", "assistant": "x", "turn_id": f"t{i}", "stamp_us": _STAMP + i,
            "patch": {"patch_id": f"p{i}", "task_id": f"k{i}", "strategy": "append",
                      "diverged": False, "patch": patch}}


def _snapshot(history: list[dict[str, Any]], pending: list[dict[str, Any]] | None = None
              ) -> str:
    return json.dumps({"participant_id": "p1", "history": history,
                       "history_version": len(history), "used": ["fast"],
                       "pending": pending or [], "initialized": True},
                      separators=(",", ":"))


SHAPES: dict[str, Callable[[], str]] = {
    "256 exchanges of 3.6 KB (redteam18)": lambda: _snapshot([
        {"user": "u" * 1800, "assistant": "a" * 1800, "turn_id": f"t{i}",
         "stamp_us": _STAMP + i} for i in range(256)]),
    "8,000 tiny exchanges": lambda: _snapshot([
        {"user": "u" * 40, "assistant": "a" * 20, "turn_id": f"t{i}", "stamp_us": _STAMP + i}
        for i in range(8000)]),
    "256 patches, 50 small lists each": lambda: _snapshot([
        _patched(i, {f"f{j}": [j, "v" * 40] for j in range(50)}) for i in range(256)]),
    "256 patches, 400 numbers each": lambda: _snapshot([
        _patched(i, {f"f{j}": j for j in range(400)}) for i in range(256)]),
    "256 patches, a list of 1,900 numbers each": lambda: _snapshot([
        _patched(i, {"x": [0] * 1900}) for i in range(256)]),
    "8 held patches of 64 KiB": lambda: _snapshot([], [
        {"patch_id": f"pp{i}", "task_id": f"k{i}", "strategy": "human_gated",
         "created_at": 1.0e9, "patch": {"task_id": f"k{i}", "digest": ["d"],
                                        "facts": {f"f{j}": "v" * 50 for j in range(1000)}}}
        for i in range(8)]),
    "8 held patches of 4,500 small keys (redteam20 F2)": lambda: _snapshot([], [
        {"patch_id": f"pp{i}", "task_id": f"k{i}", "strategy": "human_gated",
         "created_at": 1.0e9, "patch": {"task_id": f"k{i}", "digest": ["d"],
                                        "facts": {f"k{j:05d}": j for j in range(4500)}}}
        for i in range(8)]),
    "20 merged patches of 3,000 small keys (redteam20 F2)": lambda: _snapshot([
        _patched(i, {f"k{j:05d}": j for j in range(3000)}) for i in range(20)]),
}


class _Fast:
    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("fast", "fast")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        return DestinationResult("answer", "x")

    async def release(self, participant_id: str) -> None:
        return None


class _Always:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("fast")


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other tree's src directory")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = import_tree(args.baseline, "turnrouter_base")
    print("| snapshot (~1 MB record) | bytes | baseline: whole import ms | baseline: "
          "loop ms after its preparation | this tree: thread ms | this tree: loop ms |")
    print("|---|---:|---:|---:|---:|---:|")
    base_prepare = getattr(importlib.import_module("turnrouter_base._router"),
                           "prepared_import", None)
    for name, build in SHAPES.items():
        text = build()
        ours = ParticipantSnapshot.from_json(text)
        theirs = base.ParticipantSnapshot.from_json(text)
        router = AgentRouter({"fast": _Fast()}, _Always(), default_destination="fast")
        old = base.AgentRouter({"fast": _Fast()}, _Always(), default_destination="fast")
        before = _best(lambda: old.import_participant(theirs), args.repeats)  # noqa: B023
        base_loop = "n/a"
        if base_prepare is not None:
            their_ready = base_prepare(old, theirs)
            base_loop = f"{_best(lambda: old.import_participant(their_ready), args.repeats):.1f}"  # noqa: B023
        thread = _best(lambda: prepared_import(router, ours), args.repeats)  # noqa: B023
        ready = prepared_import(router, ours)
        after = _best(lambda: router.import_participant(ready), args.repeats)  # noqa: B023
        print(f"| {name} | {len(text):,} | {before:.1f} | {base_loop} | {thread:.1f} "
              f"| {after:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
