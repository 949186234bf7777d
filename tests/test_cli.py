"""The `turnrouter` command: usage, demo flags, and the deployment files' commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from turnrouter.cli import demo_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_usage_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    """No command prints usage and exits 2; --help exits 0."""
    assert main([]) == 2
    assert "usage: turnrouter" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_demo_rejects_bad_flags() -> None:
    """Non-positive durations and participant counts are usage errors."""
    with pytest.raises(SystemExit):
        main(["demo", "--duration", "0"])
    with pytest.raises(SystemExit):
        main(["demo", "--participants", "0"])


def _deployed_demo_commands() -> list[list[str]]:
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    deployment = yaml.safe_load((ROOT / "deploy/k8s/base/deployment.yaml").read_text())
    dockerfile = (ROOT / "deploy/compose/Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert cmd is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [
        compose["services"]["turnrouter"]["command"][1:],
        ["turnrouter", *container["args"]][1:],
        json.loads(cmd.group(1))[1:],
    ]


@pytest.mark.parametrize("command", _deployed_demo_commands())
def test_deployment_files_use_real_demo_flags(command: list[str]) -> None:
    """Compose, Kubernetes and the Dockerfile run `turnrouter demo` with flags it accepts,
    serving metrics on all interfaces so Prometheus can scrape the container."""
    assert command[0] == "demo"
    args = demo_parser().parse_args(command[1:])
    assert args.serve
    assert args.metrics_host == "0.0.0.0"
    assert args.metrics_port == 9464
