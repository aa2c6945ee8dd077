"""Builds dashboards/grafana/sluice.json, the Grafana dashboard for Sluice.

The JSON is committed and importable as is; this script is how it is edited, so that every
panel uses the same datasource variable and label filters. After a change run

    python dashboards/grafana/build_dashboard.py

and commit both files (tests/observability/test_dashboard_json.py checks they agree).
Every metric named here is defined in server/observability/metrics.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).with_name("sluice.json")

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
CLASS_FILTER = 'model=~"$model", traffic_class=~"$traffic_class"'
MODEL_FILTER = 'model=~"$model"'
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 8
    kind: str = "timeseries"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _quantiles(metric: str, filters: str, by: str, legend: str) -> tuple[Target, ...]:
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{'{' + filters + '}' if filters else ''}"
            "[$__rate_interval])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in QUANTILES
    )


def _latency_panel(title: str, metric: str, description: str) -> Panel:
    return Panel(
        title,
        description,
        _quantiles(metric, CLASS_FILTER, "model, traffic_class", "{{traffic_class}} {{model}}"),
        unit="s",
    )


ROWS: tuple[Row, ...] = (
    Row(
        "Latency (p50 / p90 / p99 per traffic class and model)",
        (
            _latency_panel(
                "Time to first token",
                "sluice_time_to_first_token_seconds",
                "Arrival at the server to the first generated token written to the client.",
            ),
            _latency_panel(
                "Inter-token latency",
                "sluice_inter_token_latency_seconds",
                "Gap between consecutive token writes to the client, per token.",
            ),
            _latency_panel(
                "Completion time",
                "sluice_request_duration_seconds",
                "Arrival at the server to the last byte of the response.",
            ),
            _latency_panel(
                "Queue wait",
                "sluice_queue_wait_seconds",
                "Arrival at the server to dispatch into the engine.",
            ),
        ),
    ),
    Row(
        "Interactive SLO and the bulk cap",
        (
            Panel(
                "SLO attainment",
                "Share of ended requests that met their class's objective: interactive, completed "
                "within the TTFT target and with its median gap within the inter-token target; "
                "bulk, completed. Refusals for capacity and expiries count as misses; invalid "
                "input and a tenant's own quota do not.",
                (
                    Target(
                        "sum by (model, traffic_class) (rate(sluice_slo_requests_total"
                        f'{{{CLASS_FILTER}, result="met"}}[$__rate_interval])) '
                        "/ sum by (model, traffic_class) (rate(sluice_slo_requests_total"
                        f"{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "SLO misses by reason",
                "Requests that missed their objective per second, by the first promise broken: "
                "ttft, itl (median gap), refused, expired, failed.",
                (
                    Target(
                        "sum by (traffic_class, reason) (rate(sluice_slo_requests_total"
                        f'{{{CLASS_FILTER}, result="missed"}}[$__rate_interval]))',
                        "{{reason}} ({{traffic_class}})",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Time to first token against its target",
                "p99 time to first token per class, beside the class's TTFT target in effect "
                "(a multiple of the idle engine's unless set in ms; a tenant may have its own).",
                (
                    Target(
                        "histogram_quantile(0.99, sum by (le, model, traffic_class) (rate("
                        f"sluice_time_to_first_token_seconds_bucket{{{CLASS_FILTER}}}"
                        "[$__rate_interval])))",
                        "p99 {{traffic_class}} {{model}}",
                    ),
                    Target(
                        "max by (model, traffic_class) (sluice_slo_target_seconds"
                        f'{{{CLASS_FILTER}, target="ttft"}})',
                        "target {{traffic_class}} {{model}}",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Stream median gap against its target",
                "Each stream's median gap between chunks written to the client, as its reader "
                "waits them (the figure the inter-token target judges), p50 and p95 over the "
                "streams that ended, per class, beside the class's target in effect.",
                (
                    *(
                        Target(
                            f"histogram_quantile({q}, sum by (le, model, traffic_class) (rate("
                            f"sluice_stream_median_gap_seconds_bucket{{{CLASS_FILTER}}}"
                            "[$__rate_interval])))",
                            f"p{round(100 * q)} {{{{traffic_class}}}} {{{{model}}}}",
                        )
                        for q in (0.5, 0.95)
                    ),
                    Target(
                        "max by (model, traffic_class) (sluice_slo_target_seconds"
                        f'{{{CLASS_FILTER}, target="itl"}})',
                        "target {{traffic_class}} {{model}}",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Bulk cap, knee and running bulk",
                "Bulk sequences allowed now (low while chats run, the knee otherwise), the "
                "learned knee, and the bulk requests running.",
                (
                    Target(f"max by (model) (sluice_bulk_cap_sequences{{{MODEL_FILTER}}})",
                           "cap {{model}}"),
                    Target(f"max by (model) (sluice_knee_sequences{{{MODEL_FILTER}}})",
                           "knee {{model}}"),
                    Target(
                        "sum by (model) (sluice_running_requests"
                        f'{{{MODEL_FILTER}, traffic_class="bulk"}})',
                        "running bulk {{model}}",
                    ),
                ),
            ),
            Panel(
                "The bulk controller",
                "scale: its correction of the step-time model (the cap's step budgets are "
                "multiplied by it; below 1, chats get slower gaps than the model predicts). aim: "
                "the median gap, as a share of the target, it holds chats at, learned so that "
                "slo.attainment_goal of them keep their targets: the lower of its two limits, "
                "spread (from how far the last chats strayed around the aim) and misses (a "
                "ceiling that chats over their gap target lower). pace: the speed at which bulk "
                "may start (below 1 when chats' first tokens come late behind bulk's prefills).",
                (
                    Target(
                        f"max by (model) (sluice_bulk_controller_scale{{{MODEL_FILTER}}})",
                        "scale {{model}}",
                    ),
                    Target(
                        f"max by (model) (sluice_bulk_controller_aim{{{MODEL_FILTER}}})",
                        "aim {{model}}",
                    ),
                    Target(
                        "max by (model, source) "
                        f"(sluice_bulk_controller_aim_limit{{{MODEL_FILTER}}})",
                        "aim limit, {{source}} {{model}}",
                    ),
                    Target(
                        f"max by (model) (sluice_bulk_controller_pace{{{MODEL_FILTER}}})",
                        "pace {{model}}",
                    ),
                ),
            ),
            Panel(
                "Bulk preempted for chats, by cause",
                "Running bulk requests stopped (and requeued as continuations) to keep chats "
                "within their targets, per second, by cause: chats_far_over (chats measured far "
                "over their gap target), step_over_target (a step the model predicts far over "
                "it), chat_burst (more chats than usually run together), waiting_chat (a chat "
                "waited with no budget room).",
                (
                    Target(
                        "sum by (model, cause) (rate(sluice_bulk_preemptions_total"
                        f"{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "{{cause}} {{model}}",
                    ),
                ),
                unit="reqps",
            ),
        ),
    ),
    Row(
        "Throughput and outcomes",
        (
            Panel(
                "Output tokens/s",
                "Tokens the engine generated and Sluice received, per second.",
                (
                    Target(
                        "sum by (model, traffic_class) "
                        f"(rate(sluice_generated_tokens_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "Prompt tokens/s",
                "Prompt tokens of requests dispatched to the engine, per second.",
                (
                    Target(
                        "sum by (model, traffic_class) "
                        f"(rate(sluice_prompt_tokens_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
            ),
            Panel(
                "Request rate by outcome",
                "Requests that ended per second: completed, cancelled, rejected, expired, failed, "
                "invalid.",
                (
                    Target(
                        "sum by (outcome) "
                        f"(rate(sluice_requests_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{outcome}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Rejections by reason",
                "Requests refused before or instead of dispatch, per second.",
                (
                    Target(
                        "sum by (reason, traffic_class) "
                        f"(rate(sluice_rejections_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{reason}} ({{traffic_class}})",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Requests by tenant and outcome",
                "Requests that ended per second, by configured tenant.",
                (
                    Target(
                        "sum by (tenant, outcome) "
                        "(rate(sluice_tenant_requests_total[$__rate_interval]))",
                        "{{tenant}} {{outcome}}",
                    ),
                ),
                unit="reqps",
            ),
        ),
    ),
    Row(
        "Queue and capacity",
        (
            Panel(
                "Queue depth",
                "Requests waiting in Sluice's queue, per traffic class.",
                (
                    Target(
                        f"sum by (model, traffic_class) (sluice_queue_depth{{{CLASS_FILTER}}})",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
            ),
            Panel(
                "Oldest queued request age",
                "Age of the oldest request waiting in the queue, per traffic class.",
                (
                    Target(
                        "max by (model, traffic_class) "
                        f"(sluice_queue_oldest_age_seconds{{{CLASS_FILTER}}})",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Running requests",
                "Requests dispatched to the engine and not yet ended (per class), and requests "
                "the engine itself holds.",
                (
                    Target(
                        f"sum by (model, traffic_class) (sluice_running_requests{{{CLASS_FILTER}}})",
                        "running {{traffic_class}} {{model}}",
                    ),
                    Target(
                        f"sum by (model) (sluice_engine_unfinished_requests{{{MODEL_FILTER}}})",
                        "engine unfinished {{model}}",
                    ),
                ),
            ),
            Panel(
                "Budget in use against its limit",
                "Units of each scheduler budget held by running requests, and the limit.",
                (
                    Target("sum by (budget) (sluice_budget_in_use)", "{{budget}} in use"),
                    Target("max by (budget) (sluice_budget_limit)", "{{budget}} limit"),
                ),
            ),
            Panel(
                "Budget utilisation",
                "In use over limit, per budget.",
                (
                    Target(
                        "sum by (budget) (sluice_budget_in_use) "
                        "/ max by (budget) (sluice_budget_limit)",
                        "{{budget}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Autoscale pressure",
                "Predicted queue wait over the class's deadline budget; above 1 means add "
                "capacity. The signal for a horizontal autoscaler (docs/observability.md).",
                (
                    Target(
                        "max by (model, traffic_class) "
                        f"(sluice_autoscale_pressure{{{CLASS_FILTER}}})",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Deadlines, cancellations and engine",
        (
            Panel(
                "Deadline misses",
                "Requests whose deadline passed before they completed, per second.",
                (
                    Target(
                        "sum by (model, traffic_class) "
                        f"(rate(sluice_deadline_misses_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{traffic_class}} {{model}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Cancellations",
                "Requests whose client left or cancelled, by where they were, per second.",
                (
                    Target(
                        "sum by (stage, traffic_class) "
                        f"(rate(sluice_cancellations_total{{{CLASS_FILTER}}}[$__rate_interval]))",
                        "{{stage}} ({{traffic_class}})",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Engine aborts",
                "Engine requests Sluice aborted before they finished, by reason, per second.",
                (
                    Target(
                        "sum by (model, reason) "
                        f"(rate(sluice_engine_aborts_total{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "{{reason}} {{model}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Engine healthy",
                "1 while the engine is loaded and healthy.",
                (Target(f"min by (model) (sluice_engine_healthy{{{MODEL_FILTER}}})", "{{model}}"),),
                kind="stat",
            ),
        ),
    ),
    Row(
        "Shared state (Redis: quotas and resumable generations across replicas, with "
        "state.url)",
        (
            Panel(
                "State backend up",
                "Per replica: 1 while Redis answers; 0 while the replica enforces its share "
                "of each tenant limit alone (limit / replicas counted).",
                (Target("min by (instance) (sluice_state_backend_up)", "{{instance}}"),),
                width=6,
            ),
            Panel(
                "Replicas counted",
                "Replicas renewing their leases in Redis, as each replica last counted them.",
                (Target("max by (instance) (sluice_state_replicas)", "{{instance}}"),),
                width=6,
            ),
            Panel(
                "State backend round trip",
                "Time of each call to Redis by operation: p50 / p90 / p99. On a request's "
                "path: acquire (a quota, while it is queued), open (an idempotency key) and "
                "append (a resumable stream's events, before its readers see them); off it: "
                "release, renew, and a follower's find, read and claim.",
                _quantiles("sluice_state_backend_seconds", "", "operation", "{{operation}}"),
                unit="s",
                width=6,
            ),
            Panel(
                "State backend errors/s",
                "Calls to Redis that failed or timed out, by operation. Each marks the "
                "backend down until a probe (every second) succeeds.",
                (
                    Target(
                        "sum by (operation) "
                        "(rate(sluice_state_backend_errors_total[$__rate_interval]))",
                        "{{operation}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Generations taken over/s",
                "Resumable generations this replica took over from a replica that died "
                "(its lease lapsed): continued from the logged tokens, or started afresh "
                "when nothing had been sent.",
                (
                    Target(
                        "sum by (instance, how) "
                        "(rate(sluice_state_takeovers_total[$__rate_interval]))",
                        "{{instance}} {{how}}",
                    ),
                ),
                width=6,
            ),
        ),
    ),
    Row(
        "Batch API (OpenAI batches on spare capacity)",
        (
            Panel(
                "Batches by status",
                "Batches of the Batch API in each status (in_progress, completed, ...).",
                (Target("sum by (status) (sluice_batches)", "{{status}}"),),
            ),
            Panel(
                "Batch lines/s",
                "Batch lines ended per second: completed, failed (an error response) and "
                "expired (past the completion window).",
                (
                    Target(
                        "sum by (outcome) (rate(sluice_batch_lines_total[$__rate_interval]))",
                        "{{outcome}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Batch lines offered again/s",
                "Batch lines refused for now and offered again later, per second, by the "
                "refusal's code: the server at capacity, a tenant's quota, or the line's "
                "conversation held by another response (conversation_locked). Steady retries "
                "of one code say what holds the batches back.",
                (
                    Target(
                        "sum by (code) (rate(sluice_batch_line_retries_total[$__rate_interval]))",
                        "{{code}}",
                    ),
                ),
                unit="reqps",
            ),
        ),
    ),
    Row(
        "Batch mode (engine sim-batch or batch dispatch)",
        (
            Panel(
                "Batch size",
                "Requests per dispatched batch: p50 / p90 / p99 and the mean.",
                (
                    *_quantiles("sluice_batch_size", MODEL_FILTER, "model", "{{model}}"),
                    Target(
                        f"sum by (model) (rate(sluice_batch_size_sum{{{MODEL_FILTER}}}"
                        "[$__rate_interval])) / sum by (model) "
                        f"(rate(sluice_batch_size_count{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "mean {{model}}",
                    ),
                ),
            ),
            Panel(
                "Batches dispatched/s",
                "Batches dispatched per second.",
                (
                    Target(
                        "sum by (model) "
                        f"(rate(sluice_batch_size_count{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "{{model}}",
                    ),
                ),
            ),
            Panel(
                "Batch worker failures and retries",
                "Batches lost to a worker failure, and requests re-queued after their batch "
                "failed, per second.",
                (
                    Target(
                        "sum by (model) "
                        f"(rate(sluice_worker_failures_total{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "failed batches {{model}}",
                    ),
                    Target(
                        "sum by (model) "
                        f"(rate(sluice_batch_retries_total{{{MODEL_FILTER}}}[$__rate_interval]))",
                        "retried requests {{model}}",
                    ),
                ),
            ),
        ),
    ),
)


def _variables() -> list[dict[str, Any]]:
    def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": query,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [],
            "sort": 1,
            "hide": 0,
            "regex": "",
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
            "regex": "",
            "hide": 0,
            "includeAll": False,
            "multi": False,
        },
        query_variable("model", "Model", "label_values(sluice_requests_total, model)"),
        query_variable(
            "traffic_class", "Traffic class", "label_values(sluice_requests_total, traffic_class)"
        ),
    ]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + i),
            "expr": target.expr,
            "legendFormat": target.legend,
            "range": True,
        }
        for i, target in enumerate(panel.targets)
    ]
    body: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
            **panel.options,
        },
        "targets": targets,
    }
    if panel.kind == "stat":
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
        body["fieldConfig"]["defaults"]["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}],
        }
    return body


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x = 0
                y += 8
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
        y += 8
    return {
        "title": "Sluice",
        "uid": "sluice-overview",
        "description": "Sluice streaming token server: latency, SLO attainment, the bulk cap, "
        "throughput, queueing, budgets, deadlines, cancellations and batching. Metrics are "
        "defined in server/observability/metrics.py.",
        "tags": ["sluice", "llm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    sys.stdout.write(f"wrote {OUTPUT}\n")
