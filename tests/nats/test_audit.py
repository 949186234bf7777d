"""Found by the acceptance audit (docs/distributed.md read as a newcomer would): the
walk-throughs run in a POSIX shell, and an unusable TLS or nkey file is named in the
error (the file, never what it holds)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from turnrouter import (
    AgentRouter,
    AgentTurn,
    ContextPatch,
    ContractValueError,
    Destination,
    DestinationResult,
    LifecycleError,
    ParticipantSnapshot,
    RouteDecision,
    RouteRequest,
)
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

from .conftest import ROOT, NatsServer, free_port

pytestmark = pytest.mark.anyio

DOC = ROOT / "docs" / "distributed.md"


def walkthrough(heading: str, marker: str) -> str:
    """The first ```sh block of `heading`'s section of docs/distributed.md that holds
    `marker`, as a reader copies it."""
    section = DOC.read_text(encoding="utf-8").split(f"## {heading}\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    blocks: list[str] = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    for block in blocks:
        if marker in block:
            return block
    raise AssertionError(f"no sh block with {marker!r} under {heading!r}")


@pytest.mark.parametrize(("heading", "marker"), [("On one machine", "nats-server -js"),
                                                 ("Trust", "worker_password=")])
def test_the_walkthroughs_run_in_a_posix_shell(tmp_path: Path, heading: str,
                                                marker: str) -> None:
    """Copied into a script run by `sh` (dash on Debian and Ubuntu, not bash), a
    walk-through asks its three questions and stops the worker and the server it
    started: `kill %2` names a process group, which a shell without job control does
    not make, so the worker and the server were left running and the script exited 1."""
    for entry in ("examples", "deploy"):
        (tmp_path / entry).symlink_to(ROOT / entry)
    ports = {"NATS_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
             "NATS_MONITOR_PORT": str(free_port())}
    env = {**os.environ, **ports,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough(heading, marker))
    # Files, not pipes: a process the script leaves running would hold a pipe open.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        shell = subprocess.Popen(["sh", str(script)], cwd=tmp_path, env=env, stdout=out,
                                 stderr=err, start_new_session=True)
    try:
        shell.wait(timeout=90)
        leftover = subprocess.run(["pgrep", "-s", str(shell.pid)], capture_output=True,
                                  text=True, check=False).stdout.split()
    finally:  # whatever the script left running goes with its session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    said, errors = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert "Sunny, 24 degrees." in said, errors[-2000:]
    assert shell.returncode == 0, errors[-2000:]
    assert leftover == [], f"processes the walk-through left running: {leftover}"


async def test_unusable_tls_and_nkey_files_are_named(tmp_path: Path,
                                                     nats_server: NatsServer) -> None:
    """The error names the file that cannot be used (never its content): it said
    `cannot load the TLS files: FileNotFoundError: No such file or directory`, or
    `ErrInvalidSeed()` for an nkey file holding no seed, naming none."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not-a-cert secret-in-file-6502\n")
    seed = tmp_path / "seed.nk"
    seed.write_text("SUAsecret-in-file-6502\n")
    cert = tmp_path / "client.pem"
    cert.write_text("not-a-cert secret-in-file-6502\n")
    cases = [(NatsConfig(url=nats_server.url, tls_ca_file=str(tmp_path / "missing.pem")),
              "missing.pem"),
             (NatsConfig(url=nats_server.url, tls_ca_file=str(junk)), "junk.pem"),
             (NatsConfig(url=nats_server.url, tls_cert_file=str(cert),
                         tls_key_file=str(tmp_path / "missing-key.pem")), "missing-key.pem"),
             (NatsConfig(url=nats_server.url, nkey_seed_file=str(seed)), "seed.nk")]
    for config, named in cases:
        with pytest.raises(LifecycleError) as caught:
            await NatsFrontEnd.connect(config, max_reconnect_attempts=0)
        assert named in str(caught.value), str(caught.value)
        assert "secret-in-file-6502" not in str(caught.value)


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "[1e999]"]


async def _said(router: AgentRouter, pid: str, text: str) -> None:
    await router.handle(AgentTurn(pid, f"t-{text}", text))


def _exported_with_applied_patch(facts_value: str) -> str:
    """A participant's exported JSON whose merged (applied) patch holds `facts_value`
    as a reader could find it in a record: a NaN or an overflowing number."""
    async def build() -> str:
        router = _router()
        await _said(router, "alice", "hi")
        await router.apply_context_patch("alice", ContextPatch(task_id="job", facts={"n": 1},
                                                               digest=("done",)))
        snapshot = router.export_participant("alice")
        assert snapshot is not None
        return snapshot.to_json().replace('"n":1', f'"n":{facts_value}', 1)
    return asyncio.run(build())


class _Always:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("d")


async def _speak(turn: AgentTurn, route: str, text: str) -> None:
    return None


def _router() -> AgentRouter:
    return AgentRouter({"d": _Dest("answers")}, _Always(), default_destination="d",
                       output=_speak)


class _Dest(Destination):
    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        await started()
        return DestinationResult(text="ok")


@pytest.mark.parametrize("value", NON_FINITE)
def test_an_applied_patch_holding_nan_or_infinity_is_refused_on_import(value: str) -> None:
    """The live path refuses NaN and infinity in a patch's facts (JSON has no form for
    them: a move would make them null), and so does an import for a held (pending)
    patch; an applied patch read from JSON (a NATS record) was taken as it stood and its
    next export turned the value into null. Import refuses it now: a NATS worker
    quarantines such a record and the participant starts clean."""
    snapshot = ParticipantSnapshot.from_json(_exported_with_applied_patch(value))
    with pytest.raises(ContractValueError, match="NaN or infinity"):
        _router().import_participant(snapshot)
