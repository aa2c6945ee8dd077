"""Every PromQL expression Sluice ships, evaluated by a real Prometheus scraping Sluice under load.

Two Sluice servers run on loopback: the continuous-batching `sim` engine (with a tenant, tight
queue limits and short deadlines so rejections, deadline misses and cancellations happen) and
the fixed-batch `sim-batch` engine (for the batch-size panels). Prometheus, from the Debian
package, scrapes both every second with the shipped rule files loaded. Then each expression in
the Grafana dashboard, its variables, the alerting and recording rules and the autoscaler
examples goes through /api/v1/query; any error, or a result with no series, fails the test.
So does each query of vLLM's own Grafana dashboard, which reads vLLM's series (`vllm:*`).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import RedisProcess, reserved_port

from .conftest import (
    REPO_ROOT,
    InProcessSluice,
    log_tail,
    require_tool,
    run_sluice,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.prometheus

DASHBOARD = REPO_ROOT / "dashboards" / "grafana" / "sluice.json"
PROMETHEUS_CONFIG = REPO_ROOT / "dashboards" / "prometheus" / "prometheus.yml"
RULES_DIR = REPO_ROOT / "dashboards" / "prometheus" / "rules"
KEDA = REPO_ROOT / "deploy" / "autoscaling" / "keda-scaledobject.yaml"
HPA = REPO_ROOT / "deploy" / "autoscaling" / "hpa-prometheus-adapter.yaml"

MODEL = "sluice-demo"
API_KEY = "obs-test-key"
TENANT = "observability"
# What Grafana would put in place of its variables. `$__rate_interval` is a window that covers
# the whole load phase, so rates and quantiles are computed from real increases.
RATE_WINDOW = "2m"
GRAFANA_VARIABLES = {
    "$__rate_interval": RATE_WINDOW,
    "$__interval": "15s",
    "$__range": RATE_WINDOW,
    "$model": ".*",
    "$traffic_class": ".*",
}
# Kubernetes service-discovery labels the autoscaler examples select on.
NAMESPACE = "sluice"
POISON_MARKER = "POISON"  # sim-batch's default --poison-marker
SCRAPE_TIMEOUT_S = 90.0

SLUICE_CONFIG = {
    # The limit is never reached (the queues are far smaller); with the Redis the continuous
    # server shares it through, every request takes and returns a lease.
    "tenants": {TENANT: {"api_keys": [API_KEY], "max_concurrent": 64}},
    "classes": {
        "interactive": {"max_queued": 4},
        "bulk": {"max_queued": 4},
    },
    "budgets": {"max_running_seqs": 4},
    # Rate priors far above the sim's real speed, never updated: Sluice admits requests whose
    # deadline it will then miss while they run (deadline misses, engine aborts "deadline").
    # (No start-up calibration: it would replace them with what the engine shows.)
    "estimates": {
        "prefill_tokens_per_s": 1e7,
        "decode_tokens_per_s": 1e6,
        "smoothing": 0.0,
        "calibrate": False,
    },
}


@dataclass(frozen=True)
class Expression:
    where: str
    expr: str


# --- collecting the expressions ------------------------------------------------------------


def _substitute(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    expr = expr.replace("${model}", ".*").replace("${traffic_class}", ".*")
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def dashboard_expressions() -> list[Expression]:
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[Expression] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append(
                    Expression(
                        f"panel {panel['title']!r} target {target['refId']}",
                        _substitute(target["expr"]),
                    )
                )

    walk(dashboard["panels"])
    return found


def dashboard_variable_queries() -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of each `label_values(selector, label)` variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = (
            variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        )
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"variable {variable['name']}: unsupported query {query!r}"
        found.append((variable["name"], match.group(1).strip(), match.group(2)))
    return found


def rule_groups() -> list[dict[str, Any]]:
    groups = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        groups.extend(yaml.safe_load(path.read_text())["groups"])
    return groups


_COMPARISON = re.compile(r"\s(>=|<=|==|!=|>|<)\s+(?!bool\b)")


def as_bool_comparisons(expr: str) -> str:
    """An alert expression with its threshold comparisons made `bool`: it then returns every
    series it compares (0 or 1) instead of only the firing ones, so "no series" means broken
    (a misspelt metric or label), not "not firing"."""
    return _COMPARISON.sub(lambda m: f" {m.group(1)} bool ", expr)


def rule_expressions() -> list[Expression]:
    found = []
    for group in rule_groups():
        for rule in group["rules"]:
            if "record" in rule:
                found.append(Expression(f"recording rule {rule['record']}", rule["expr"]))
                found.append(Expression(f"recorded series {rule['record']}", rule["record"]))
            else:
                found.append(
                    Expression(f"alert {rule['alert']}", as_bool_comparisons(rule["expr"]))
                )
    return found


def autoscaler_expressions() -> list[Expression]:
    keda = yaml.safe_load(KEDA.read_text())
    found = [
        Expression(f"KEDA trigger {i}", trigger["metadata"]["query"])
        for i, trigger in enumerate(keda["spec"]["triggers"])
        if trigger["type"] == "prometheus"
    ]
    adapter_config = yaml.safe_load(
        next(d for d in yaml.safe_load_all(HPA.read_text()) if d["kind"] == "ConfigMap")["data"][
            "config.yaml"
        ]
    )
    for rule in adapter_config["rules"]:
        metric = rule["name"]["as"]
        found.append(Expression(f"prometheus-adapter seriesQuery {metric}", rule["seriesQuery"]))
        found.append(
            Expression(
                f"prometheus-adapter metricsQuery {metric}",
                rule["metricsQuery"]
                .replace("<<.GroupBy>>", "namespace, pod")
                .replace("<<.Series>>", metric)
                .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}"'),
            )
        )
    return found


def test_every_dashboard_expression_is_collected() -> None:
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    text = " ".join(e.expr for e in expressions)
    for metric in (
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_inter_token_latency_seconds_bucket",
        "sluice_request_duration_seconds_bucket",
        "sluice_generated_tokens_total",
        "sluice_requests_total",
        "sluice_rejections_total",
        "sluice_queue_depth",
        "sluice_queue_oldest_age_seconds",
        "sluice_running_requests",
        "sluice_budget_in_use",
        "sluice_budget_limit",
        "sluice_deadline_misses_total",
        "sluice_cancellations_total",
        "sluice_engine_aborts_total",
        "sluice_batch_size_bucket",
        "sluice_autoscale_pressure",
    ):
        assert metric in text, f"no panel reads {metric}"


def test_bool_comparisons_rewrite() -> None:
    assert as_bool_comparisons("a > 0.1 and b < 1") == "a > bool 0.1 and b < bool 1"
    assert as_bool_comparisons("a >= bool 2") == "a >= bool 2"
    assert as_bool_comparisons('x{le="0.5"} / y') == 'x{le="0.5"} / y'


# --- the processes ---------------------------------------------------------------------------


@dataclass
class RunningPrometheus:
    url: str

    def api(self, path: str, **params: str) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10.0)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])


class PrometheusError(AssertionError):
    pass


def _prometheus_config(targets: dict[str, int]) -> dict[str, Any]:
    """The shipped prometheus.yml, pointed at the test servers, scraping every second."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES_DIR / "*.yml")]
    [job] = config["scrape_configs"]
    job["static_configs"] = [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {
                **job["static_configs"][0].get("labels", {}),
                "namespace": NAMESPACE,
                "pod": pod,
            },
        }
        for pod, port in targets.items()
    ]
    return config


@contextmanager
def _start_prometheus(tmp_path: Path, targets: dict[str, int]) -> Iterator[RunningPrometheus]:
    binary = require_tool("prometheus")
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(_prometheus_config(targets)))
    port = reserved_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prometheus = RunningPrometheus(f"http://127.0.0.1:{port}")
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{log_tail(log_path)}")
            return httpx.get(f"{prometheus.url}/-/ready", timeout=2.0).status_code == 200

        wait_until(ready, timeout_s=60, interval_s=0.2, what="prometheus /-/ready")
        yield prometheus
    finally:
        stop_process(process)


# --- the load ----------------------------------------------------------------------------------


def _chat_body(
    max_tokens: int, content: str = "tell me about sluices", **extra: Any
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def _stream_chat(
    client: httpx.AsyncClient,
    headers: dict[str, str],
    body: dict[str, Any],
    *,
    leave_after: int | None = None,
) -> int:
    """Stream one chat completion; with `leave_after`, disconnect after that many events.
    Returns the HTTP status."""
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers=headers
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        events = 0
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events += 1
                if leave_after is not None and events >= leave_after:
                    return response.status_code  # closing the stream disconnects
        return response.status_code


async def _drive_load(
    server: InProcessSluice, *, seconds: float, with_pressure: bool = False, poison: bool = False
) -> list[int]:
    """Completed streams in both classes for `seconds`; with `with_pressure`, also bursts that
    overflow the queues, requests with deadlines they cannot meet, clients that leave
    mid-stream and a prompt too long for the model; with `poison`, a prompt that crashes its
    batch (the sim-batch engine's failure injection)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as client:

        async def steady(traffic_class: str) -> None:
            headers = {**auth, "X-Traffic-Class": traffic_class}
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                statuses.append(await _stream_chat(client, headers, _chat_body(64)))
                completion = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "sluice gates", "max_tokens": 16},
                    headers=headers,
                )
                statuses.append(completion.status_code)

        async def pressure() -> None:
            headers = {**auth, "X-Traffic-Class": "interactive"}
            # Clients that leave mid-stream: cancellations and engine aborts.
            for _ in range(3):
                statuses.append(
                    await _stream_chat(client, headers, _chat_body(1500), leave_after=3)
                )
            # Deadlines too short for the work: deadline misses.
            statuses.extend(
                await asyncio.gather(
                    *(
                        _stream_chat(
                            client, {**headers, "X-Request-Timeout-Ms": "150"}, _chat_body(1500)
                        )
                        for _ in range(4)
                    )
                )
            )
            # A burst far past max_running_seqs + max_queued: rejections and a queue.
            for traffic_class in ("interactive", "bulk"):
                statuses.extend(
                    await asyncio.gather(
                        *(
                            _stream_chat(
                                client, {**auth, "X-Traffic-Class": traffic_class}, _chat_body(400)
                            )
                            for _ in range(24)
                        )
                    )
                )
            # A prompt longer than the model: an invalid request.
            too_long = " ".join(["sluice"] * 5000)
            statuses.append(await _stream_chat(client, headers, _chat_body(16, too_long)))

        async def poisoned() -> None:
            body = _chat_body(16, f"{POISON_MARKER} in the water")
            statuses.append(await _stream_chat(client, auth, body))

        tasks = [steady("interactive"), steady("bulk")]
        if with_pressure:
            tasks.append(pressure())
        if poison:
            tasks.append(poisoned())
        await asyncio.gather(*tasks)
    return statuses


# --- the test ----------------------------------------------------------------------------------


@contextmanager
def _stack(tmp_path: Path) -> Iterator[tuple[RunningPrometheus, InProcessSluice, InProcessSluice]]:
    config_path = tmp_path / "sluice.yml"
    config_path.write_text(yaml.safe_dump(SLUICE_CONFIG))
    common = ("--served-model-name", MODEL, "--config", str(config_path))
    with (
        RedisProcess(tmp_path) as redis,
        run_sluice(
            tmp_path, *common, "--state-url", redis.url, engine="sim", name="sluice-sim"
        ) as continuous,
        run_sluice(tmp_path, *common, engine="sim-batch", name="sluice-sim-batch") as batch,
        _start_prometheus(
            tmp_path, {"sluice-0": continuous.port, "sluice-batch-0": batch.port}
        ) as prometheus,
    ):
        yield prometheus, continuous, batch


def _scraped_after(prometheus: RunningPrometheus, moment: float) -> bool:
    """Every target is up and was last scraped after `moment` (a Unix time)."""
    targets = prometheus.api("targets")["activeTargets"]
    return bool(targets) and all(
        t["health"] == "up" and _unix(t["lastScrape"]) > moment for t in targets
    )


def _unix(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _rules_evaluated(prometheus: RunningPrometheus, moment: float) -> list[dict[str, Any]] | None:
    """Every loaded rule, once all have been evaluated after `moment`."""
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    if rules and all(_unix(r["lastEvaluation"]) > moment for r in rules):
        return rules
    return None


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(_finite(series["value"][1]) for series in result)


def _finite(value: str) -> bool:
    return value not in ("NaN", "+Inf", "-Inf")


@dataclass
class Loaded:
    """The stack after its load: every Sluice scraped and every rule evaluated since."""

    prometheus: RunningPrometheus
    continuous: InProcessSluice
    continuous_statuses: list[int]
    batch_statuses: list[int]
    rules: list[dict[str, Any]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    require_tool("prometheus")
    with _stack(tmp_path_factory.mktemp("prometheus-stack")) as (prometheus, continuous, batch):

        async def load() -> list[list[int]]:
            return list(
                await asyncio.gather(
                    _drive_load(continuous, seconds=8.0, with_pressure=True),
                    _drive_load(batch, seconds=8.0, poison=True),
                )
            )

        continuous_statuses, batch_statuses = asyncio.run(load())
        load_ended = time.time()
        wait_until(
            lambda: _scraped_after(prometheus, load_ended + 1.0),
            timeout_s=SCRAPE_TIMEOUT_S,
            what="a scrape of every Sluice after the load",
        )
        rules = wait_until(
            lambda: _rules_evaluated(prometheus, load_ended + 1.0),
            timeout_s=SCRAPE_TIMEOUT_S,
            what="an evaluation of every rule after the load",
        )
        yield Loaded(prometheus, continuous, continuous_statuses, batch_statuses, rules)


def test_every_expression_returns_data_from_a_real_prometheus(loaded: Loaded) -> None:
    prometheus, continuous = loaded.prometheus, loaded.continuous
    continuous_statuses, batch_statuses = loaded.continuous_statuses, loaded.batch_statuses
    assert 200 in continuous_statuses and 200 in batch_statuses
    assert any(s in (429, 503) for s in continuous_statuses), continuous_statuses
    assert 400 in continuous_statuses, continuous_statuses
    unhealthy = [(r["name"], r.get("lastError")) for r in loaded.rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy

    expressions = dashboard_expressions() + rule_expressions() + autoscaler_expressions()
    failures = _without_data(prometheus, expressions)
    for variable, selector, label in dashboard_variable_queries():
        values = prometheus.api(f"label/{label}/values", **{"match[]": selector})
        if not values:
            failures.append(f"variable ${variable}: label_values({selector}, {label}) is empty")
    assert not failures, (
        f"{len(failures)} of {len(expressions)} expressions failed:\n"
        + "\n".join(failures)
        + f"\n--- sim log ---\n{log_tail(continuous.log_path)}"
    )


def _without_data(prometheus: RunningPrometheus, expressions: list[Expression]) -> list[str]:
    """Each expression that is invalid, or returns no series or only NaN/Inf, and why."""
    failures = []
    for expression in expressions:
        try:
            result = prometheus.query(expression.expr)
        except PrometheusError as exc:
            failures.append(f"{expression.where}: invalid: {exc}\n    {expression.expr}")
            continue
        if not result:
            failures.append(f"{expression.where}: no series\n    {expression.expr}")
        elif not _has_data(result):
            failures.append(f"{expression.where}: only NaN/Inf: {result}\n    {expression.expr}")
    return failures


# --- vLLM's own dashboard ----------------------------------------------------------------------
# What vLLM's Grafana dashboard queries (in vLLM's repository:
# examples/observability/prometheus_grafana/grafana.json, formerly under examples/online_serving/),
# described here in our words, not copied: its variable `model_name` is
# `label_values(model_name)`, and every query selects `{model_name="$model_name"}`.
VLLM_QUANTILES = (0.99, 0.95, 0.9, 0.5)
# Latencies it draws as those quantiles of their histograms and as their means (sum over count).
VLLM_LATENCIES = (
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)
VLLM_RATES = (  # counters, and histograms' sums, it draws as rates
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_LENGTHS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens")  # by bucket
VLLM_BY_REASON = "vllm:request_success_total"  # increases by finished_reason


def vllm_dashboard_expressions() -> list[Expression]:
    chosen, window = f'{{model_name="{MODEL}"}}', RATE_WINDOW
    found = []
    for name in VLLM_LATENCIES:
        for q in VLLM_QUANTILES:
            found.append(
                Expression(
                    f"{name} p{q * 100:g}",
                    f"histogram_quantile({q}, sum by(le) (rate({name}_bucket{chosen}[{window}])))",
                )
            )
        found.append(
            Expression(
                f"{name} mean",
                f"rate({name}_sum{chosen}[{window}]) / rate({name}_count{chosen}[{window}])",
            )
        )
    found += [Expression(f"{n} rate", f"rate({n}{chosen}[{window}])") for n in VLLM_RATES]
    found += [Expression(n, f"{n}{chosen}") for n in VLLM_GAUGES]
    found += [
        Expression(f"{n} by bucket", f"sum by(le) (increase({n}_bucket{chosen}[{window}]))")
        for n in VLLM_LENGTHS
    ]
    found.append(
        Expression(
            "finish reasons",
            f"sum by(finished_reason) (increase({VLLM_BY_REASON}{chosen}[{window}]))",
        )
    )
    return found


def test_vllm_s_dashboard_reads_sluice_replicas(loaded: Loaded) -> None:
    """vLLM's own dashboard, pointed at Sluice replicas (the sim and sim-batch engines): its
    variable lists the served model, each of its queries returns data, and each replica exports
    every series it reads."""
    prometheus = loaded.prometheus
    assert MODEL in prometheus.api("label/model_name/values")  # label_values(model_name)
    expressions = vllm_dashboard_expressions()
    failures = _without_data(prometheus, expressions)
    assert not failures, f"{len(failures)} of {len(expressions)} failed:\n" + "\n".join(failures)
    read = {
        *VLLM_GAUGES,
        VLLM_BY_REASON,
        *VLLM_RATES,
        *(f"{n}_bucket" for n in (*VLLM_LATENCIES, *VLLM_LENGTHS)),
    }
    for pod in ("sluice-0", "sluice-batch-0"):
        exported = {
            series["metric"]["__name__"]
            for series in prometheus.query(
                f'count by(__name__) ({{__name__=~"vllm:.+", pod="{pod}", model_name="{MODEL}"}})'
            )
        }
        assert read - exported == set(), pod
