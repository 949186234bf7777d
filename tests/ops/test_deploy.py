"""Schema-aware checks of deploy/: compose, collector, Grafana provisioning, Kubernetes.

Docker cannot run here, so these tests check what can be checked without it: every file
parses, every referenced file exists, and names, ports and paths agree across files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrouter.ops import (
    COMPOSE_RULES,
    DEMO_OVERRIDES,
    K8S_DASHBOARDS,
    K8S_RULE,
    RULES_FILE,
    dashboard_files,
    read_overrides,
    render_rules,
    rule_groups,
)

from .conftest import DEPLOY, ROOT

COMPOSE_DIR = DEPLOY / "compose"
K8S_BASE = DEPLOY / "k8s/base"
METRICS_PORT = 9464


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = _load(COMPOSE_DIR / "compose.yaml")
    return loaded


def _service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = _compose()["services"][name]
    return service


def _bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path (resolved against the compose directory)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE_DIR / source).resolve()
    return mounts


def _k8s(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S_BASE / name).read_text()) if doc]


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("*")
                   if p.suffix in {".yml", ".yaml"}))
def test_every_yaml_file_parses(path: str) -> None:
    """Every YAML file under deploy/ parses."""
    documents = list(yaml.safe_load_all((ROOT / path).read_text()))
    assert documents and all(doc is not None for doc in documents)


# ---------------------------------------------------------------- compose


def test_compose_has_the_stack() -> None:
    """The demo, the collector, a trace backend, Prometheus, Alertmanager and Grafana are
    services."""
    assert set(_compose()["services"]) == {
        "turnrouter", "otel-collector", "jaeger", "prometheus", "alertmanager", "grafana"}


def test_compose_bind_mounts_and_build_files_exist() -> None:
    """Every host path a service mounts, and the demo's build context and Dockerfile, exist."""
    for name, service in _compose()["services"].items():
        for target, source in _bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"
    build = _service("turnrouter")["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).is_file()


def test_compose_named_volumes_are_declared() -> None:
    """Named volumes used by services are declared at the top level."""
    declared = set(_compose()["volumes"])
    for service in _compose()["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared


def test_compose_depends_on_known_services() -> None:
    """depends_on names only services of the file."""
    services = set(_compose()["services"])
    for service in _compose()["services"].values():
        assert set(service.get("depends_on", [])) <= services


def test_demo_serves_metrics_on_the_port_prometheus_scrapes() -> None:
    """The demo command, its published port and Prometheus' scrape target agree on 9464."""
    demo = _service("turnrouter")
    command = demo["command"]
    assert command[:3] == ["turnrouter", "demo", "--serve"]
    assert command[command.index("--metrics-port") + 1] == str(METRICS_PORT)
    assert f"{METRICS_PORT}:{METRICS_PORT}" in demo["ports"]
    scrape = _load(DEPLOY / "prometheus/prometheus.yml")["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets["turnrouter"] == [f"turnrouter:{METRICS_PORT}"]
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert f"EXPOSE {METRICS_PORT}" in dockerfile


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.nats.yaml"])
def test_every_compose_prometheus_stores_exemplars(compose: str) -> None:
    """Both stacks provision the overview and tuning dashboards, which request exemplars:
    their Prometheus stores them (operator18: compose.nats.yaml's did not, so the dots
    never showed)."""
    services = _load(COMPOSE_DIR / compose)["services"]
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]


def test_prometheus_runs_with_exemplars_and_the_generated_rules() -> None:
    """Prometheus has exemplar storage on, its config mounted, and the rules directory."""
    prometheus = _service("prometheus")
    assert "--enable-feature=exemplar-storage" in prometheus["command"]
    config_flag = next(f for f in prometheus["command"] if f.startswith("--config.file="))
    mounts = _bind_mounts(prometheus)
    assert mounts[config_flag.split("=", 1)[1]] == DEPLOY / "prometheus/prometheus.yml"
    (rule_glob,) = _load(DEPLOY / "prometheus/prometheus.yml")["rule_files"]
    rules_dir = mounts[str(Path(rule_glob).parent)]
    assert rules_dir == (ROOT / COMPOSE_RULES).parent
    assert sorted(p.name for p in rules_dir.glob(Path(rule_glob).name)) == [
        Path(COMPOSE_RULES).name]


def test_compose_rules_are_the_shipped_rules_with_the_demo_overrides() -> None:
    """The compose Prometheus loads the shipped rules with the demo's overrides (its slow
    routes do not page) and sends alerts to the compose Alertmanager, which mounts the
    shipped configuration."""
    rules = (ROOT / COMPOSE_RULES).read_text()
    expected = render_rules(overrides=read_overrides(ROOT / DEMO_OVERRIDES))
    assert rules.endswith(expected)
    assert 'route="travel"' in rules
    alertmanager = _service("alertmanager")
    config_flag = next(f for f in alertmanager["command"] if f.startswith("--config.file="))
    assert _bind_mounts(alertmanager)[config_flag.split("=", 1)[1]] == (
        DEPLOY / "alertmanager/alertmanager.yml")
    (target,) = _load(DEPLOY / "prometheus/prometheus.yml")["alerting"]["alertmanagers"]
    assert target["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert "9093:9093" in alertmanager["ports"]


def test_collector_pipeline_memory_limiter_batch_and_trace_backend() -> None:
    """OTLP in; memory_limiter first, then batch; traces to Jaeger's OTLP port."""
    config = _load(DEPLOY / "otel-collector/config.yaml")
    collector = _service("otel-collector")
    mounted = _bind_mounts(collector)
    config_flag = next(a for a in collector["command"] if a.startswith("--config="))
    assert mounted[config_flag.split("=", 1)[1]] == DEPLOY / "otel-collector/config.yaml"
    pipelines = config["service"]["pipelines"]
    for pipeline in pipelines.values():
        assert pipeline["receivers"] == ["otlp"]
        assert pipeline["processors"] == ["memory_limiter", "batch"]
        for component in ("receivers", "processors", "exporters"):
            assert set(pipeline[component]) <= set(config[component])
    (trace_exporter,) = pipelines["traces"]["exporters"]
    host, port = config["exporters"][trace_exporter]["endpoint"].split(":")
    assert host == "jaeger" and port == "4317"
    assert _service("jaeger")["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    metrics_port = config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    scrape = _load(DEPLOY / "prometheus/prometheus.yml")["scrape_configs"]
    assert {"targets": [f"otel-collector:{metrics_port}"]} in [
        job["static_configs"][0] for job in scrape]


def test_demo_exports_traces_to_a_collector_receiver() -> None:
    """The demo's OTLP endpoint is the collector's OTLP/HTTP receiver, published by compose."""
    env = _service("turnrouter")["environment"]
    config = _load(DEPLOY / "otel-collector/config.yaml")
    http_port = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{http_port}"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def test_grafana_datasources_link_exemplars_to_the_trace_backend() -> None:
    """Prometheus and Jaeger datasources point at compose services; exemplars link by uid."""
    provisioning = COMPOSE_DIR / "grafana/provisioning"
    assert _bind_mounts(_service("grafana"))["/etc/grafana/provisioning"] == provisioning
    datasources = {d["uid"]: d for d in
                   _load(provisioning / "datasources/datasources.yaml")["datasources"]}
    prometheus, jaeger = datasources["prometheus"], datasources["jaeger"]
    assert prometheus["type"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"
    assert "9090:9090" in _service("prometheus")["ports"]
    assert jaeger["type"] == "jaeger" and jaeger["url"] == "http://jaeger:16686"
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id"  # the exemplar label turnrouter writes
    assert link["datasourceUid"] == jaeger["uid"]


@pytest.mark.parametrize(("provisioning", "prometheus_config"), [
    ("provisioning", "prometheus.yml"), ("provisioning-nats", "prometheus.nats.yml")])
def test_grafana_datasource_scrape_interval_is_the_prometheus_one(
        provisioning: str, prometheus_config: str) -> None:
    """Each provisioned Prometheus datasource's "Scrape interval" (`timeInterval`) is its
    Prometheus' scrape interval: Grafana derives `$__rate_interval` from it, and a 15 s
    default under a 1-minute scrape left 28 of 62 panel queries empty."""
    datasources = _load(COMPOSE_DIR / f"grafana/{provisioning}/datasources/datasources.yaml")
    (prometheus,) = [d for d in datasources["datasources"] if d["type"] == "prometheus"]
    scrape = _load(DEPLOY / "prometheus" / prometheus_config)["global"]["scrape_interval"]
    assert prometheus["jsonData"]["timeInterval"] == scrape


def test_grafana_loads_the_generated_dashboards() -> None:
    """The dashboard provider's path is where compose mounts dashboards/."""
    providers = _load(COMPOSE_DIR / "grafana/provisioning/dashboards/dashboards.yaml")
    (provider,) = providers["providers"]
    mounts = _bind_mounts(_service("grafana"))
    assert mounts[provider["options"]["path"]] == ROOT / "dashboards"
    home = _service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == provider["options"]["path"]
    assert Path(home).name in dashboard_files()


# ---------------------------------------------------------------- kubernetes


def test_kustomization_resources_exist() -> None:
    """Every resource the kustomizations list exists."""
    for kustomization in DEPLOY.glob("k8s/**/kustomization.yaml"):
        for resource in _load(kustomization)["resources"]:
            assert (kustomization.parent / resource).exists(), f"{kustomization}: {resource}"


def test_prometheus_rule_equals_the_rule_file() -> None:
    """The PrometheusRule's spec is exactly the checked-in rule file."""
    (rule,) = _k8s(Path(K8S_RULE).name)
    assert rule["kind"] == "PrometheusRule"
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == _load(ROOT / RULES_FILE) == rule_groups(
        overrides=read_overrides(ROOT / DEMO_OVERRIDES))


def test_dashboards_configmaps_equal_the_dashboard_files() -> None:
    """The dashboards ConfigMaps (one per dashboard) carry the checked-in dashboard JSON,
    sidecar-labelled, under distinct names."""
    configmaps = _k8s(Path(K8S_DASHBOARDS).name)
    assert all(c["kind"] == "ConfigMap" for c in configmaps)
    assert all(c["metadata"]["labels"]["grafana_dashboard"] == "1" for c in configmaps)
    assert len({c["metadata"]["name"] for c in configmaps}) == len(configmaps)
    on_disk = {p.name: json.loads(p.read_text()) for p in (ROOT / "dashboards").glob("*.json")}
    data = {name: json.loads(text) for c in configmaps for name, text in c["data"].items()}
    assert data == on_disk
    assert all(len(c["data"]) == 1 for c in configmaps)
    assert all(model["uid"] for model in data.values())


def test_servicemonitor_sets_job_from_a_label() -> None:
    """`jobLabel`: the job is the app's name label, not the Service's name, so the rules'
    cluster/namespace/job grouping keeps two deployments apart."""
    (monitor,) = _k8s("servicemonitor.yaml")
    label = monitor["spec"]["jobLabel"]
    (service,) = _k8s("service.yaml")
    assert service["metadata"]["labels"][label] == "turnrouter"


def test_deployment_service_and_servicemonitor_agree() -> None:
    """Selectors match pod labels; the named metrics port and 9464 agree everywhere."""
    (deployment,) = _k8s("deployment.yaml")
    (service,) = _k8s("service.yaml")
    (monitor,) = _k8s("servicemonitor.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    args = container["args"]
    assert args[:2] == ["demo", "--serve"]
    assert int(args[args.index("--metrics-port") + 1]) == port["containerPort"] == METRICS_PORT
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == port["name"] == service_port["name"]
    assert service_port["port"] == METRICS_PORT
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]
    # Readiness follows admission control (docs/telemetry.md, /ready); liveness does not.
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"


BASE_KINDS = ["ConfigMap", "ConfigMap", "Deployment", "PrometheusRule", "Service",
              "ServiceMonitor"]


@pytest.mark.parametrize(("overlay", "kinds"), [
    ("base", BASE_KINDS), ("overlays/example", BASE_KINDS),
    # The NATS fleet: the main PrometheusRule (TurnrouterTargetDown, TurnrouterAbsent)
    # beside the fleet's, the fleet, overview and tuning dashboards' ConfigMaps, NATS and
    # the workers.
    *((overlay, ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "PrometheusRule",
                 "PrometheusRule", "Service", "Service", "ServiceMonitor", "StatefulSet"])
      for overlay in ("nats", "overlays/nats-example"))])
def test_kustomize_builds(overlay: str, kinds: list[str]) -> None:
    """`kubectl kustomize` renders the layout, each object under the object size limit
    (`kubectl apply --server-side`, as the docs say); skipped where kubectl is not
    installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the files are validated above")
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / overlay)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    documents = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert sorted(doc["kind"] for doc in documents) == kinds
    for doc in documents:  # applied server-side (test_manifests_are_applied_the_way_they_fit)
        size = len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
        assert size < OBJECT_LIMIT, (doc["metadata"]["name"], size)


def test_nats_kustomization_carries_the_main_prometheus_rule() -> None:
    """deploy/k8s/nats lists the main rules' PrometheusRule and the overview and tuning
    dashboards (kustomize loads no file outside its root, so they are generated copies of
    the base's) beside the fleet's: the runbook's fleet sections open the overview."""
    resources = _load(DEPLOY / "k8s/nats/kustomization.yaml")["resources"]
    assert {"prometheusrule.yaml", "prometheusrule-nats.yaml",
            "dashboards-configmap.yaml"} <= set(resources)
    assert (DEPLOY / "k8s/nats/prometheusrule.yaml").read_text() == (
        ROOT / K8S_RULE).read_text()
    assert (DEPLOY / "k8s/nats/dashboards-configmap.yaml").read_text() == (
        ROOT / K8S_DASHBOARDS).read_text()


@pytest.mark.parametrize("overlay", ["example", "nats-example"])
def test_the_example_overlays_set_the_label_an_operator_selects_on(overlay: str) -> None:
    """Each example overlay (the demo's and the NATS fleet's) sets the `release` label a
    kube-prometheus-stack's rule and monitor selectors match, on every object but not on
    selectors (operator15: the NATS layout had none, its rules were ignored)."""
    kustomization = _load(DEPLOY / "k8s/overlays" / overlay / "kustomization.yaml")
    (resource,) = kustomization["resources"]
    assert (DEPLOY / "k8s/overlays" / overlay / resource / "kustomization.yaml").is_file()
    (labels,) = kustomization["labels"]
    assert labels == {"pairs": {"release": "kube-prometheus-stack"},
                      "includeSelectors": False}


#: The API server's bound on all annotations of an object (a client-side `kubectl apply`
#: stores the whole object in one, `kubectl.kubernetes.io/last-applied-configuration`).
ANNOTATIONS_LIMIT = 262_144
#: The object size etcd accepts (server-side apply stores no copy in an annotation).
OBJECT_LIMIT = 1024 * 1024
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _last_applied_size(obj: dict[str, Any]) -> int:
    """Bytes of the annotations a client-side `kubectl apply` would give `obj`: its own
    plus the object as compact JSON, as Go writes it (`<`, `>` and `&` escaped as
    `\\u003c`..., six bytes each: PromQL has many)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&":
        text = text.replace(char, f"\\u{ord(char):04x}")
    own = sum(len(k.encode()) + len(str(v).encode())
              for k, v in (obj.get("metadata", {}).get("annotations") or {}).items())
    return own + len(LAST_APPLIED) + len(text.encode())


def _apply_commands() -> list[tuple[str, str]]:
    """(file, line) of every `kubectl apply` the docs and the kustomizations give."""
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
             *sorted((DEPLOY / "k8s").rglob("kustomization.yaml"))]
    return [(path.relative_to(ROOT).as_posix(), line) for path in files
            for line in path.read_text().splitlines() if "kubectl apply" in line]


def test_manifests_are_applied_the_way_they_fit() -> None:
    """Every object of deploy/k8s stays under the object limit, and either under the
    annotation limit of a client-side `kubectl apply` or every `kubectl apply` the docs
    give is `--server-side` (operator18 M3: the tuning dashboard's ConfigMap comes to
    about 286,000 bytes of last-applied annotation, past the 262,144 the API server
    takes, and operations.md said `kubectl apply -k`)."""
    objects = [doc for path in sorted((DEPLOY / "k8s").rglob("*.yaml"))
               if path.name != "kustomization.yaml"
               for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert any(doc["kind"] == "ConfigMap" for doc in objects)
    too_big = {doc["metadata"]["name"] for doc in objects
               if _last_applied_size(doc) >= ANNOTATIONS_LIMIT}
    for doc in objects:
        size = len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
        assert size < OBJECT_LIMIT, (doc["metadata"]["name"], size)
    commands = _apply_commands()
    assert any(path == "docs/operations.md" for path, _ in commands)
    if too_big:
        client_side = [(path, line) for path, line in commands if "--server-side" not in line]
        assert client_side == [], f"{sorted(too_big)} are too big for a client-side apply"


def test_the_annotation_size_is_what_kubectl_stores() -> None:
    """The size counts Go's escapes: `a<b` takes 3 bytes in Python's JSON, 8 in Go's."""
    small = {"kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"q": "a<b"}}
    plain = len(json.dumps(small, separators=(",", ":")))
    assert _last_applied_size(small) == len(LAST_APPLIED) + plain + 5
