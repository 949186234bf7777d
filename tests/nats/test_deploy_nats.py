"""deploy/ files of the NATS runtime: compose, Kubernetes, alerts, the fleet dashboard."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from turnrouter.cli import worker_parser
from turnrouter.ops import K8S_RULE, RULES_FILE, generated_files, queries
from turnrouter.runtime.nats import NatsConfig, NatsWorker
from turnrouter.telemetry import METRICS

from .app import make_router
from .conftest import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose/compose.nats.yaml"
K8S = DEPLOY / "k8s/nats"
RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"
RULE_TESTS = DEPLOY / "prometheus/tests-nats/turnrouter-nats.rules.test.yml"
DASHBOARD = K8S / "turnrouter-fleet.json"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s(name: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc}


def runtime_registry() -> CollectorRegistry:
    """A registry holding the runtime's families, as a worker registers them."""
    registry = CollectorRegistry()
    NatsWorker(make_router, NatsConfig(), registry=registry)
    return registry


def exposed_names() -> set[str]:
    """Series names the worker exposes: the runtime's families and the router's."""
    names = {spec.name for spec in METRICS}
    for family in runtime_registry().collect():
        names.update(sample.name for sample in family.samples)
    return names | {name + suffix for name in set(names)
                    for suffix in ("_bucket", "_sum", "_count")}


def check_worker_args(args: list[str]) -> Any:
    """Worker flags parse, the app resolves, and /metrics is on 0.0.0.0:9464."""
    assert args[0] == "worker"
    parsed = worker_parser().parse_args(args[1:])
    module, _, attribute = parsed.app.partition(":")
    assert callable(getattr(importlib.import_module(module), attribute))
    assert (parsed.metrics_host, parsed.metrics_port) == ("0.0.0.0", 9464)
    return parsed


def test_compose_runs_nats_with_jetstream_and_three_workers() -> None:
    """Compose: NATS with JetStream on a volume; three workers on it, all scraped."""
    compose = load(COMPOSE)
    services = compose["services"]
    assert services["nats"]["command"][0] == "-js"
    workers = sorted(name for name in services if name.startswith("worker-"))
    assert workers == ["worker-1", "worker-2", "worker-3"]
    for name in workers:
        command = services[name]["command"]
        assert command[0] == "turnrouter"
        parsed = check_worker_args(command[1:])
        assert parsed.nats == "nats://nats:4222"
        assert services[name]["stop_signal"] == "SIGTERM"
    scrape = load(DEPLOY / "prometheus/prometheus.nats.yml")["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets["turnrouter"] == [f"{name}:9464" for name in workers]


def test_compose_restarts_workers_and_waits_for_a_healthy_server() -> None:
    """A worker past its outage bound exits 1: compose restarts it (and the server); a
    worker starts once the server's JetStream answers its health check, and is healthy
    while its ready file exists."""
    services = load(COMPOSE)["services"]
    nats = services["nats"]
    assert nats["restart"] == "unless-stopped"
    probe = nats["healthcheck"]["test"]
    assert probe[0] == "CMD" and probe[-1].startswith("http://127.0.0.1:8222/healthz")
    assert "8222" in nats["command"]  # the monitoring port the probe asks
    for name in (name for name in services if name.startswith("worker-")):
        worker = services[name]
        assert worker["restart"] == "unless-stopped"
        assert worker["depends_on"] == {"nats": {"condition": "service_healthy"}}
        parsed = check_worker_args(worker["command"][1:])
        assert worker["healthcheck"]["test"] == ["CMD", "test", "-f", parsed.ready_file]


def test_compose_mounts_and_volumes_exist() -> None:
    """Every host path mounted exists; named volumes are declared."""
    compose = load(COMPOSE)
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).resolve().exists(), f"{name}: {source}"
            else:
                assert source in compose["volumes"]


def test_compose_prometheus_loads_the_main_and_the_fleet_rules() -> None:
    """The fleet's Prometheus mounts the main rules where the demo stack does (without
    TurnrouterTargetDown and TurnrouterAbsent nothing fires when every worker dies) and
    the fleet's beside them; its config's rule_files read exactly those two files."""
    prometheus = load(COMPOSE)["services"]["prometheus"]
    demo = load(DEPLOY / "compose/compose.yaml")["services"]["prometheus"]
    assert "../prometheus/rules:/etc/prometheus/rules:ro" in demo["volumes"]
    assert "../prometheus/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]
    assert "../prometheus/rules-nats:/etc/prometheus/rules-nats:ro" in prometheus["volumes"]
    mounts = {target: (COMPOSE.parent / source).resolve() for source, target, *_ in
              (volume.split(":") for volume in prometheus["volumes"])
              if source.startswith(".")}
    config = load(DEPLOY / "prometheus/prometheus.nats.yml")
    assert mounts["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus/prometheus.nats.yml"
    loaded = sorted(path.relative_to(ROOT).as_posix() for glob in config["rule_files"]
                    for path in mounts[str(Path(glob).parent)].glob(Path(glob).name))
    assert loaded == sorted([RULES_FILE, str(RULES.relative_to(ROOT))])
    # ... and notified: the same Alertmanager and configuration as the demo's stack
    # (operator15: the fleet's alerts, the watchdog too, went nowhere).
    alertmanager = load(COMPOSE)["services"]["alertmanager"]
    assert alertmanager == load(DEPLOY / "compose/compose.yaml")["services"]["alertmanager"]
    (target,) = config["alerting"]["alertmanagers"]
    assert target["static_configs"][0]["targets"] == ["alertmanager:9093"]


def test_kubernetes_runs_three_workers_against_the_nats_service() -> None:
    """Kubernetes: three workers whose flags parse, pointing at the nats Service's client
    port; labels, selectors and the metrics port agree."""
    kustomization = load(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file()
    for generator in kustomization["configMapGenerator"]:
        assert all((K8S / f).is_file() for f in generator["files"])
    workers = k8s("workers.yaml")
    deployment = workers["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    parsed = check_worker_args(container["args"])
    nats = k8s("nats.yaml")
    client = next(p for p in nats["Service"]["spec"]["ports"] if p["name"] == "client")
    assert parsed.nats == f"nats://{nats['Service']['metadata']['name']}:{client['port']}"
    assert nats["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"][0] == "-js"
    assert workers["Service"]["spec"]["selector"].items() <= labels.items()
    assert workers["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= (
        workers["Service"]["metadata"]["labels"].items())
    assert container["ports"][0]["containerPort"] == 9464


def test_prometheus_rule_equals_the_rule_file() -> None:
    """The PrometheusRules' specs are exactly the compose rule files: the fleet's, and
    the main one (the same object as the base's)."""
    rule = k8s("prometheusrule-nats.yaml")["PrometheusRule"]
    assert rule["spec"] == load(RULES)
    main = k8s("prometheusrule.yaml")["PrometheusRule"]
    assert main["spec"] == load(ROOT / RULES_FILE)
    assert (K8S / "prometheusrule.yaml").read_text() == (ROOT / K8S_RULE).read_text()


def test_kustomize_renders_both_prometheus_rules() -> None:
    """`kubectl kustomize deploy/k8s/nats` renders the main PrometheusRule beside the
    fleet's (skipped where kubectl is not installed)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the files are validated above")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    rules = {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(result.stdout)
             if doc and doc["kind"] == "PrometheusRule"}
    assert sorted(rules) == ["turnrouter", "turnrouter-nats"]
    alerts = {rule["alert"] for doc in rules.values() for group in doc["spec"]["groups"]
              for rule in group["rules"] if "alert" in rule}
    assert {"TurnrouterTargetDown", "TurnrouterAbsent",
            "TurnrouterPartitionUnconsumed"} <= alerts


def test_fleet_dashboard_queries_only_exposed_series() -> None:
    """Every query of the fleet dashboard (generated) selects series a worker exposes,
    and every runtime family has a panel."""
    model = json.loads(DASHBOARD.read_text())
    assert model["uid"] == "turnrouter-fleet"
    exposed = exposed_names()
    used = set()
    for where, expr in queries(model):
        for name in re.findall(r"\bturnrouter_[a-z_]+", expr):
            assert name in exposed, f"{name} in {where} ({expr!r}) is not exposed"
            used.add(name.removesuffix("_bucket"))
    families = {f.name + ("_total" if f.type == "counter" else "")
                for f in runtime_registry().collect()}
    assert families <= used, families - used
    titles = {p["title"] for p in model["panels"]}
    assert "Partitions owned per replica" in titles


def test_fleet_dashboard_draws_its_alerts_lines_and_no_nan_when_idle() -> None:
    """The runbook's "the dashboards draw the same lines": the input wait panel draws
    the backlog alert's threshold, the fencing panel the fenced-writes alert's (with the
    fleet total the alert sums); every quantile is kept only where its window holds
    observations, so an idle fleet shows a gap, not NaN (ops11)."""
    model = json.loads(DASHBOARD.read_text())
    rules = {rule["alert"]: rule["expr"] for group in load(RULES)["groups"]
             for rule in group["rules"] if "alert" in rule}
    panels = {p["title"]: p for p in model["panels"]}

    def line(title: str) -> float:
        defaults = panels[title]["fieldConfig"]["defaults"]
        assert defaults["custom"]["thresholdsStyle"]["mode"] != "off", title
        (step,) = [s["value"] for s in defaults["thresholds"]["steps"] if s["value"]]
        return float(step)

    backlog = line("Input wait")
    assert f"> {backlog:g}\n" in rules["TurnrouterInputBacklog"]
    fenced = line("Refused state writes (fencing) and turns ended by a takeover")
    assert rules["TurnrouterFencedWrites"].endswith(f"> {fenced:g}")
    quantiles = [expr for _where, expr in queries(model) if "histogram_quantile" in expr]
    assert quantiles and all("_count" in expr and "> 0)" in expr for expr in quantiles)
    # Beside each line, what its alert evaluates: each job's value over the alert's 5
    # minutes, not a per-stage or per-instance one over the rate interval (operator15).
    for title, alert in (("Input wait", "TurnrouterInputBacklog"),
                         ("Refused state writes (fencing) and turns ended by a takeover",
                          "TurnrouterFencedWrites")):
        (alerted,) = [t for t in panels[title]["targets"] if alert in t["legendFormat"]]
        assert "by (job" in alerted["expr"] and "[5m]" in alerted["expr"], alerted
        assert "$__rate_interval" not in alerted["expr"] and "{{job}}" in alerted["legendFormat"]
    assert 'stage="delivery"' in next(t for t in panels["Input wait"]["targets"]
                                  if "InputBacklog" in t["legendFormat"])["expr"]


def test_fleet_partition_totals_are_per_job() -> None:
    """The partitions panel compares each job's owned partitions with its own
    deployment: under the default job "All", two fleets' totals summed against one
    deployment's count hid a gap (operator15 F5)."""
    model = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in model["panels"]
                if p["title"] == "Partitions: fleet total vs deployment"]
    for target in panel["targets"]:
        assert re.match(r"(sum|max) by \(job\) \(", target["expr"]), target
        assert target["legendFormat"].startswith("{{job}}"), target


def test_fleet_files_are_generated_by_turnrouter_ops() -> None:
    """The fleet dashboard, its rule file and PrometheusRule come from
    `python -m turnrouter.ops` (the checked-in copies are what it writes)."""
    generated = generated_files(root=ROOT)  # the main rules carry the demo overrides
    for path in (DASHBOARD, RULES, K8S / "prometheusrule-nats.yaml",
                 K8S / "prometheusrule.yaml"):
        relative = str(path.relative_to(ROOT))
        assert generated[relative] == path.read_text(), relative


def test_alerts_read_only_exposed_series() -> None:
    """The alert expressions select series a worker exposes."""
    exposed = exposed_names()
    for group in load(RULES)["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"\bturnrouter_[a-z_]+", rule["expr"]):
                assert name in exposed


@pytest.mark.parametrize("command", [["check", "rules", str(RULES)],
                                     ["test", "rules", str(RULE_TESTS)]])
def test_promtool_accepts_and_tests_the_alerts(command: list[str]) -> None:
    """promtool (Debian package) checks the rules and runs their unit tests: the partition
    alert fires after a minute without an owner and stays quiet otherwise."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    result = subprocess.run([promtool, *command], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
