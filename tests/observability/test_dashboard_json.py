"""The shipped dashboard and configs are well formed and importable as they are."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from typing import Any

import yaml

from server.observability.metrics import Metrics

from .conftest import REPO_ROOT, require_tool

GRAFANA = REPO_ROOT / "dashboards" / "grafana"
DASHBOARD = GRAFANA / "sluice.json"


def _load_builder() -> Any:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(_all_panels(panel.get("panels", [])))
    return found


def test_committed_dashboard_is_what_the_builder_makes() -> None:
    assert DASHBOARD.read_text() == _load_builder().render(), (
        "dashboards/grafana/sluice.json is stale: run python dashboards/grafana/build_dashboard.py"
    )


def test_every_datasource_reference_is_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    references = []

    def collect(node: object) -> None:
        if isinstance(node, dict):
            if "datasource" in node and isinstance(node["datasource"], dict):
                references.append(node["datasource"])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(dashboard)
    assert references
    assert all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in references)
    assert "__inputs" not in dashboard  # nothing to fill in on import


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    panels = _all_panels(json.loads(DASHBOARD.read_text())["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_dashboard_reads_only_metrics_sluice_exports() -> None:
    exported: set[str] = set()
    for family in Metrics().registry.collect():  # every metric in server/observability/metrics.py
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
        }.get(family.type, ("",))
        exported.update(family.name + suffix for suffix in suffixes)
    rules = [
        rule["expr"]
        for path in (REPO_ROOT / "dashboards" / "prometheus" / "rules").glob("*.yml")
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]
    text = DASHBOARD.read_text() + "\n".join(rules)
    used = set(re.findall(r"\bsluice_[a-z_]+\b", text))
    assert used - exported == set()


def test_provisioning_points_grafana_at_the_dashboard_and_prometheus() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert "uid" not in source
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/sluice.yml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_promtool_accepts_the_prometheus_config_and_rules() -> None:
    promtool = require_tool("promtool")
    config = REPO_ROOT / "dashboards" / "prometheus" / "prometheus.yml"
    result = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sorted((REPO_ROOT / "dashboards" / "prometheus" / "rules").glob("*.yml"))
    assert rules
    result = subprocess.run(
        [promtool, "check", "rules", *map(str, rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
