"""Per-decision CPU time of `LexicalDecisions` against an earlier commit's, in one process.

The earlier `_lexical.py` is read with `git show REF:...` and loaded beside the current
one; both score the same queries in alternating passes (thread CPU time, so a shared
machine's scheduler does not count), and the medians and their ratio are printed:

- CLINC150: all train utterances as examples, the ten domains + `conversation`
  (11 candidates), the 3,000 validation queries;
- demo sample: the shipped sample's examples and 11 routes, its queries five times.

Usage: PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/compare_lexical.py [--ref 0fd4331]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_decisions import CONVERSATION, DEFAULT_DATA, require_data

from turnrouter import AgentTurn, RouteRequest, RoutingAid
from turnrouter.decisions import LexicalDecisions
from turnrouter.demo import DESCRIPTIONS, load_sample

PATH = "src/turnrouter/decisions/_lexical.py"


def _load_reference(ref: str) -> Any:
    """The `LexicalDecisions` class of `ref`'s `_lexical.py`, as a sibling module."""
    source = subprocess.run(["git", "show", f"{ref}:{PATH}"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    name = "turnrouter.decisions._lexical_reference"
    spec = importlib.util.spec_from_file_location(name, handle.name)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {PATH} at {ref}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    Path(handle.name).unlink()
    return module.LexicalDecisions


def _median_cpu(score: Callable[[RouteRequest], object], requests: Sequence[RouteRequest]
                ) -> float:
    for request in requests[:200]:
        score(request)
    timings: list[float] = []
    for request in requests:
        start = time.thread_time_ns()
        score(request)
        timings.append((time.thread_time_ns() - start) / 1000.0)
    return statistics.median(timings)


def _compare(label: str, old: Any, new: LexicalDecisions,
             requests: Sequence[RouteRequest], passes: int) -> None:
    for number in range(passes):
        before = _median_cpu(old.score, requests)
        after = _median_cpu(new.score, requests)
        print(f"{label} pass {number + 1}: reference {before:.1f} us, current {after:.1f} us, "
              f"ratio {after / before:.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    """Compare both workloads and print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ref", default="0fd4331",
                        help="the commit to compare with (default: before issue 18's second pass)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    reference = _load_reference(args.ref)
    data = require_data(args.data)
    examples: dict[str, list[str]] = {}
    with (data / "train.jsonl").open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            examples.setdefault(row["domain"], []).append(row["text"])
    with (data / "val.jsonl").open(encoding="utf-8") as handle:
        queries = [json.loads(line)["text"] for line in handle if line.strip()]
    aids = (*(RoutingAid(domain, "") for domain in examples), CONVERSATION)
    requests = [RouteRequest(AgentTurn("bench", "t", text), aids) for text in queries]
    _compare("CLINC150, 11 candidates", reference(examples), LexicalDecisions(examples),
             requests, args.passes)
    sample = load_sample()
    demo_aids = tuple(RoutingAid(name, text) for name, text in DESCRIPTIONS.items())
    demo = [RouteRequest(AgentTurn("bench", "t", text), demo_aids)
            for text, _, _ in sample.queries] * 5
    _compare("demo sample, 11 candidates", reference(sample.examples),
             LexicalDecisions(examples=sample.examples), demo, args.passes)


if __name__ == "__main__":
    main()
