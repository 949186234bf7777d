"""The checked-in dashboards, rules and manifests are exactly what the generator makes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnrouter.ops import (
    ACK_OVERUSE_RATIO,
    CLARIFICATION_CRITICAL,
    CLARIFICATION_WARNING,
    DASHBOARDS,
    K8S_RULE,
    RULES_FILE,
    RUNBOOK_URL,
    candidates,
    dashboards,
    generated_files,
    main,
    queries,
    stale_files,
)
from turnrouter.telemetry import METRICS

from .conftest import ROOT

MODELS = dashboards()


def _panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in model["panels"] if panel["type"] != "row"]


def _panel(title: str) -> dict[str, Any]:
    (found,) = [p for model in MODELS.values() for p in _panels(model) if p["title"] == title]
    return found


def test_checked_in_files_are_up_to_date() -> None:
    """Regenerating in memory gives the checked-in files (run `python -m turnrouter.ops`)."""
    stale = stale_files(ROOT)
    assert stale == {}, "out of date, run `python -m turnrouter.ops`:\n" + "".join(
        stale.values())


def test_check_command_passes_on_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m turnrouter.ops --check` exits 0 on the checked-in tree."""
    assert main(["--check", "--root", str(ROOT)]) == 0


def test_check_command_reports_a_stale_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--check exits 1 and names the file when a generated file was edited by hand."""
    assert main(["--root", str(tmp_path)]) == 0
    target = tmp_path / "dashboards" / "turnrouter-overview.json"
    target.write_text(target.read_text().replace("turnrouter overview", "edited"))
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "out of date: dashboards/turnrouter-overview.json" in capsys.readouterr().err


def test_runbook_url_points_every_alert_at_your_runbook(tmp_path: Path) -> None:
    """--runbook-url writes rules (file and PrometheusRule) linking to that runbook."""
    import yaml

    base = "https://wiki.example.com/voice/turnrouter-runbook"
    assert main(["--root", str(tmp_path), "--runbook-url", base]) == 0
    for path, key in (("deploy/prometheus/rules/turnrouter.rules.yml", None),
                      ("deploy/k8s/base/prometheusrule.yaml", "spec"),
                      ("deploy/prometheus/rules-nats/turnrouter-nats.rules.yml", None),
                      ("deploy/k8s/nats/prometheusrule-nats.yaml", "spec")):
        content = yaml.safe_load((tmp_path / path).read_text())
        groups = (content[key] if key else content)["groups"]
        alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
        assert alerts
        for alert in alerts:  # the NATS fleet's alerts too
            url = alert["annotations"]["runbook_url"]
            assert url == f"{base}#{alert['alert'].lower()}", url


def _alerts_in(text: str) -> list[dict[str, Any]]:
    """The alerting rules of a generated YAML file: a rule file's groups, or a
    PrometheusRule's (none for the other files)."""
    import yaml

    alerts = []
    for doc in yaml.safe_load_all(text):
        if isinstance(doc, dict):
            spec = doc.get("spec") if doc.get("kind") == "PrometheusRule" else doc
            groups = spec.get("groups", []) if isinstance(spec, dict) else []
            alerts += [rule for group in groups for rule in group["rules"] if "alert" in rule]
    return alerts


def test_every_generated_alert_links_to_its_runbook_section() -> None:
    """Every alert of every rule file the generator writes (the router's and the NATS
    fleet's, as rule files and as PrometheusRules) has a `runbook_url` pointing at its
    own section of docs/runbook.md, and that section exists."""
    runbook = (ROOT / "docs/runbook.md").read_text()
    headings = [line.removeprefix("## ") for line in runbook.splitlines()
                if line.startswith("## ")]
    found = {path: _alerts_in(text) for path, text in generated_files().items()
             if path.endswith((".yml", ".yaml"))}
    rule_files = {path: alerts for path, alerts in found.items() if alerts}
    assert set(rule_files) >= {RULES_FILE, K8S_RULE,
                               "deploy/prometheus/rules-nats/turnrouter-nats.rules.yml",
                               "deploy/k8s/nats/prometheusrule-nats.yaml"}
    for path, alerts in rule_files.items():
        for alert in alerts:
            name = alert["alert"]
            assert name in headings, f"{name} ({path}) has no section in docs/runbook.md"
            # GitHub's anchor for the heading `## TurnrouterX` is `#turnrouterx`.
            assert alert["annotations"].get("runbook_url") == (
                f"{RUNBOOK_URL}#{name.lower()}"), f"{name} in {path}"


@pytest.mark.parametrize("argv", [["--runbook-url", "wiki/runbook"],
                                  ["--check", "--runbook-url", "https://x.example/r"]])
def test_runbook_url_is_checked(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A runbook URL that is not http(s), or one given with --check, is refused by name."""
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--root", str(ROOT)])
    assert raised.value.code == 2
    assert "--runbook-url" in capsys.readouterr().err


def test_generation_is_deterministic() -> None:
    """Two generations are byte-identical."""
    assert generated_files() == generated_files()


def test_dashboard_files_are_json_with_unique_uids() -> None:
    """Each dashboard file parses as JSON; uids and titles are unique and as specified."""
    texts = {name: (ROOT / "dashboards" / name).read_text() for name in DASHBOARDS}
    loaded = {name: json.loads(text) for name, text in texts.items()}
    assert sorted(m["title"] for m in loaded.values()) == [
        "turnrouter acknowledgment tuning", "turnrouter overview"]
    assert len({m["uid"] for m in loaded.values()}) == len(loaded)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dashboard_has_datasource_job_and_route_variables(name: str) -> None:
    """A datasource variable, and multi-value job and route variables on that datasource."""
    variables = {v["name"]: v for v in MODELS[name]["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for key in ("job", "route"):
        assert variables[key]["datasource"]["uid"] == "${datasource}"
        assert variables[key]["includeAll"] and variables[key]["multi"]
    assert "route" in variables["route"]["query"]["query"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_panel_uses_the_datasource_variable_and_a_unit(name: str) -> None:
    """Panels and targets query `${datasource}`; every panel states a unit."""
    for panel in _panels(MODELS[name]):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_panels_do_not_overlap(name: str) -> None:
    """Grid positions stay within 24 columns and never overlap."""
    cells: set[tuple[int, int]] = set()
    for panel in MODELS[name]["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


def test_latency_panels_show_exemplars() -> None:
    """Every range histogram_quantile / heatmap target over an exemplar-carrying
    histogram (METRICS) asks for exemplars."""
    traced = [spec.name for spec in METRICS if spec.type == "histogram"]
    latency = [(p["title"], t) for model in MODELS.values() for p in _panels(model)
               for t in p["targets"]
               if t["range"] and any(name in t["expr"] for name in traced)
               and ("histogram_quantile" in t["expr"] or t["format"] == "heatmap")]
    assert latency
    assert [title for title, target in latency if not target["exemplar"]] == []


def test_clarification_panel_draws_the_alert_thresholds() -> None:
    """The clarification ratio panel draws the warning and critical alert thresholds."""
    panel = _panel("Clarification ratio")
    defaults = panel["fieldConfig"]["defaults"]
    steps = [step["value"] for step in defaults["thresholds"]["steps"]]
    assert steps == [None, CLARIFICATION_WARNING, CLARIFICATION_CRITICAL]
    assert defaults["custom"]["thresholdsStyle"]["mode"] != "off"
    assert defaults["unit"] == "percentunit"


def test_the_silence_panel_draws_what_dead_air_evaluates_beside_its_line() -> None:
    """TurnrouterDeadAir reads each job's silence p95 over all routes and 5 minutes; the
    panel drawing its line has that series too, not only per-route p95s over the rate
    interval (operator15: routes slow by design sat above the line, the job healthy)."""
    (job_wide,) = [t for t in _panel("Silence p95 vs configured delay")["targets"]
                   if t["refId"] == "C"]
    expr = job_wide["expr"]
    assert expr.startswith("histogram_quantile(0.95, sum by (job, le) (rate(")
    assert "[5m]" in expr and "$__rate_interval" not in expr and "route=" not in expr
    assert "TurnrouterDeadAir" in job_wide["legendFormat"]


@pytest.mark.parametrize("title", ["Clarification ratio", "Failures by stage"])
def test_panels_drawing_a_job_wide_alert_threshold_draw_one_line_per_job(title: str) -> None:
    """The alerts are per job: a panel drawing their threshold sums per job too, so a
    paging job is not averaged under the line with the healthy ones when several jobs
    are selected (operator15: 10% drawn under "All" while one job paged at 68%)."""
    panel = _panel(title)
    for target in panel["targets"]:
        expr = target["expr"]
        assert "sum(" not in expr.replace(" ", ""), (title, expr)
        assert expr.count("sum by (job") == expr.count("sum"), (title, expr)
        assert target["legendFormat"].startswith("{{job}}"), (title, target)


def test_a_count_on_the_right_axis_is_drawn_there_in_plain_numbers() -> None:
    """A target whose legend says "right axis" (the clarified participants beside the
    clarification ratios) has an override putting it there with a unit of its own:
    without one, 114 participants read as 11400 % on the ratios' axis (ops11)."""
    found = 0
    for model in MODELS.values():
        for panel in _panels(model):
            overrides = {o["matcher"]["options"]: {p["id"]: p["value"] for p in o["properties"]}
                         for o in panel.get("fieldConfig", {}).get("overrides", [])
                         if o["matcher"]["id"] == "byFrameRefID"}
            for target in panel["targets"]:
                if "right axis" in target.get("legendFormat", ""):
                    found += 1
                    assert overrides.get(target["refId"]) == {
                        "custom.axisPlacement": "right", "unit": "short"}, panel["title"]
    assert found


def test_acknowledgment_dashboard_has_the_required_panels() -> None:
    """First-response quantiles, heatmap by route, silence vs delay, ack outcomes, what-if."""
    titles = {p["title"] for p in _panels(MODELS["turnrouter-acknowledgment-tuning.json"])}
    assert {"First response quantiles", "First response heatmap: $route",
            "Silence p95 vs configured delay", "Acknowledgments: emitted vs suppressed",
            "Needless acknowledgments per turn", "Predicted vs observed first response",
            "Which delay? What-if per candidate delay and route", "Recommended delay",
            "Configured delay", "Acknowledgment generation time"} <= titles
    heatmap = _panel("First response heatmap: $route")
    assert heatmap["type"] == "heatmap" and heatmap["repeat"] == "route"
    quantiles = [t["expr"] for t in _panel("First response quantiles")["targets"]
                 if t["expr"].startswith("histogram_quantile")]
    assert [q.split(",")[0] for q in quantiles] == [
        "histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.95"]
    # The delay each route runs with (per-route overrides included), not one line.
    silence = " ".join(t["expr"] for t in _panel("Silence p95 vs configured delay")["targets"])
    assert "max by (route) (turnrouter_acknowledgment_route_delay_seconds" in silence
    configured = _panel("Configured delay")["targets"]
    assert [t["legendFormat"] for t in configured] == ["{{route}}"]
    assert "max by (route) (turnrouter_acknowledgment_route_delay_seconds" in configured[0][
        "expr"]


def test_which_delay_table_covers_every_candidate_and_marks_the_current_one() -> None:
    """The what-if table has ack, needless and silence per route and over all routes, for
    every candidate delay, under the predictive policy (with the approximated trigger's
    `early` column) and the fixed delay, and a `current` marker from the
    configured-delay gauge."""
    panel = _panel("Which delay? What-if per candidate delay and route")
    targets = {t["refId"]: t for t in panel["targets"]}
    assert all(t["instant"] and t["format"] == "table" for t in targets.values())
    delays = [f'"delay", "{c.delay:g}"' for c in candidates()]
    assert len(delays) >= 10
    for target in targets.values():
        assert all(d in target["expr"] for d in delays), target["refId"]
    # Each route's row marks its own delay; the all-routes row the router-wide one.
    assert "turnrouter_acknowledgment_route_delay_seconds" in targets["F"]["expr"]
    assert "turnrouter_acknowledgment_delay_seconds" in targets["F"]["expr"]
    assert "on (delay, route)" in targets["F"]["expr"]
    # Acknowledgment rates count the turns interrupted before a response; the panel says
    # how far that goes.
    for ref in ("A", "B", "H", "I"):
        assert "turnrouter_first_response_interrupted_seconds_bucket" in targets[ref]["expr"]
    assert "interrupted before a response" in panel["description"]
    for ref in ("B", "D", "I", "K"):
        assert '"route", "(all)"' in targets[ref]["expr"], ref
    names = panel["transformations"][1]["options"]["renameByName"]
    assert {names[f"Value #{ref}"] for ref in targets} == {
        "early", "ack rate", "needless", "p95 silence", "fixed: ack rate", "fixed: needless",
        "fixed: p95 silence", "current"}
    # The predictive columns and `early` read the trigger's decision; the fixed ones not.
    for ref in ("A", "B", "C", "D", "E", "G"):
        assert "group_left" in targets[ref]["expr"], ref
    for ref in ("H", "I", "J", "K", "L"):
        assert "group_left" not in targets[ref]["expr"], ref
    assert "APPROXIMATION" in panel["description"]


def test_every_candidate_reads_buckets_on_bounds() -> None:
    """Every instant the model reads falls on a first-response bucket bound."""
    (spec,) = [s for s in METRICS if s.name == "turnrouter_first_response_seconds"]
    assert spec.buckets is not None
    bounds = {round(b, 6) for b in spec.buckets}
    for c in candidates():
        assert c.instants <= bounds


def test_overview_covers_every_metric_family_between_the_dashboards() -> None:
    """Every metric family in METRICS is shown on at least one dashboard."""
    used = " ".join(expr for model in MODELS.values() for _, expr in queries(model))
    assert [spec.name for spec in METRICS if spec.name not in used] == []


def test_first_response_panels_draw_each_routes_alert_threshold() -> None:
    """The first-response panels draw the threshold TurnrouterSlowFirstResponse uses for
    each route: the shipped overrides' (travel 4 s) and the default for the others."""
    from turnrouter.ops import DEMO_OVERRIDES, read_overrides

    from .conftest import ROOT

    models = dashboards(overrides=read_overrides(ROOT / DEMO_OVERRIDES))
    for model in models.values():
        exprs = [expr for where, expr in queries(model) if "First response" in where
                 and "* 0 + 4" in expr]
        assert len(exprs) == 1
        (expr,) = exprs
        assert 'route="travel"' in expr and "* 0 + 1.5" in expr
    assert not [expr for model in dashboards().values() for _, expr in queries(model)
                if 'route="travel"' in expr]


def test_a_fixed_threshold_line_only_where_every_route_has_that_threshold() -> None:
    """Per-route overrides give routes their own threshold, or none: the panels drawing
    TurnrouterSlowFirstResponse's and TurnrouterAcknowledgmentOveruse's lines then draw
    each route's as a series and no fixed line that applies to some routes only
    (operator15 F5: a 1.5 s line beside routes alerted at 4 s, a 50 % line over a route
    whose alert is disabled). Without overrides the fixed line stays."""
    from turnrouter.ops import DEMO_OVERRIDES, read_overrides

    titles = {"First response p95 by route": "TurnrouterSlowFirstResponse",
              "First response quantiles": "TurnrouterSlowFirstResponse",
              "Acknowledgment ratio by route": "TurnrouterAcknowledgmentOveruse"}

    def panels(models: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {p["title"]: p for model in models.values() for p in _panels(model)
                if p["title"] in titles}

    def mode(panel: dict[str, Any]) -> str:
        return str(panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"])

    plain = panels(MODELS)
    overridden = panels(dashboards(overrides=read_overrides(ROOT / DEMO_OVERRIDES)))
    assert set(plain) == set(overridden) == set(titles)
    for title in titles:
        assert mode(plain[title]) == "dashed", title
        assert mode(overridden[title]) == "off", title
        for models in (plain, overridden):
            (threshold,) = [t for t in models[title]["targets"]
                            if t["legendFormat"] == "alert threshold {{route}}"]
            assert "* 0 +" in threshold["expr"], title
    ack = next(t["expr"] for t in overridden["Acknowledgment ratio by route"]["targets"]
           if t["legendFormat"] == "alert threshold {{route}}")
    # travel's overuse alert is disabled in the demo overrides: no line for it, and the
    # default's line excludes it.
    assert 'route!~"travel"' in ack and 'route="travel"' not in ack
    assert f"* 0 + {ACK_OVERUSE_RATIO:g}" in ack


def test_route_alert_panels_draw_what_their_alert_evaluates() -> None:
    """operator22 F4: with the job variable on All, the acknowledgment ratio panel
    merged every job by route (it showed every route under the line while the alert
    fired at 0.48 and 0.77 for one job), and the first-response panel had no series of
    the alert's own signal. Each now draws it: per job and route, over 5 minutes."""
    ack = _panel("Acknowledgment ratio by route")
    (alerted,) = [t for t in ack["targets"] if "alerted" in t["legendFormat"]]
    assert "sum by (job, route)" in alerted["expr"] and "[5m]" in alerted["expr"]
    assert alerted["legendFormat"].startswith("{{job}} {{route}}")
    first = _panel("First response p95 by route")
    (signal,) = [t for t in first["targets"]
                 if "TurnrouterSlowFirstResponse" in t["legendFormat"]]
    assert "sum by (job, route, le)" in signal["expr"] and "[5m]" in signal["expr"]
    # TurnrouterRouteFailing: failures per turn of the route (not of the job), by job,
    # route and stage, over 5 minutes, beside the route's threshold and the floor's count.
    failing = _panel("Failures by route")
    (ratio,) = [t for t in failing["targets"]
                if "TurnrouterRouteFailing" in t["legendFormat"]]
    assert ratio["expr"].startswith("sum by (job, route, stage) (rate(")
    assert "/ ignoring (stage) group_left ()" in ratio["expr"]
    assert "[5m]" in ratio["expr"] and "$__rate_interval" not in ratio["expr"]
    assert ratio["legendFormat"].startswith("{{job}} {{route}} {{stage}}")
    (reached,) = [t for t in failing["targets"] if "right axis" in t["legendFormat"]]
    assert reached["expr"].startswith("sum by (job, route) (increase(")
    assert [t for t in failing["targets"] if t["legendFormat"] == "alert threshold {{route}}"]
