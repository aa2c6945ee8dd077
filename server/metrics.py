"""Every Prometheus metric Sluice exports, in one place.

Naming follows Prometheus conventions: `sluice_` prefix, base units with `_seconds`, counters
end in `_total`. Label sets are bounded: model (served names), traffic_class (two values),
outcome/reason/budget (fixed vocabularies), tenant (configured tenants only, counters only).
The README's "Metrics" section defines each one precisely.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
)
_DURATION_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

# The label values known in advance, each labelled counter's vocabulary: `initialise` creates
# every series at zero, so dashboards and alerts see 0 rather than nothing before the first event.
TRAFFIC_CLASSES = ("interactive", "bulk")
OUTCOMES = ("completed", "cancelled", "rejected", "expired", "failed", "invalid")
REJECTION_REASONS = (
    "invalid_api_key",
    "traffic_class_not_allowed",
    "tenant_quota_exceeded",
    "overloaded",
    "deadline_unmeetable",
    "engine_unavailable",
    "shutting_down",
    "too_many_failed_attempts",
)
CANCEL_STAGES = ("queued", "running")
ABORT_REASONS = ("client_cancelled", "deadline", "preempted")
# sluice_slo_requests_total{result, reason}: met requests have reason "none"; a miss names the
# first promise broken. Bulk has no latency targets: it misses only by not completing.
SLO_RESULTS: dict[str, tuple[tuple[str, str], ...]] = {
    "interactive": (
        ("met", "none"),
        ("missed", "ttft"),
        ("missed", "itl"),
        ("missed", "refused"),
        ("missed", "expired"),
        ("missed", "failed"),
    ),
    "bulk": (("met", "none"), ("missed", "refused"), ("missed", "expired"), ("missed", "failed")),
}

# --- Per-request timings (recorded by the server as bytes reach the client) ---
TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_time_to_first_token_seconds",
    "Arrival at the server to the first generated token written to the client.",
    ["model", "traffic_class"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "sluice_inter_token_latency_seconds",
    "Gap between consecutive writes of generated tokens to the client, divided evenly "
    "among the tokens of the later write.",
    ["model", "traffic_class"],
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "sluice_request_duration_seconds",
    "Arrival at the server to the last byte of the response written.",
    ["model", "traffic_class"],
    buckets=_DURATION_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "sluice_queue_wait_seconds",
    "Arrival at the server to dispatch into the engine.",
    ["model", "traffic_class"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
BATCH_LINE_OUTCOMES = ("completed", "failed", "expired")
BATCHES = Gauge(
    "sluice_batches",
    "Batches (the Batch API) by status.",
    ["status"],
    registry=REGISTRY,
)
BATCH_LINES = Counter(
    "sluice_batch_lines",
    "Batch lines that ended: completed, failed (an error response) or expired.",
    ["outcome"],
    registry=REGISTRY,
)
REQUESTS = Counter(
    "sluice_requests",
    "Requests that ended, by outcome.",
    ["model", "traffic_class", "outcome"],
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "sluice_generated_tokens",
    "Tokens the engine generated and Sluice received.",
    ["model", "traffic_class"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "sluice_prompt_tokens",
    "Prompt tokens of requests dispatched to the engine.",
    ["model", "traffic_class"],
    registry=REGISTRY,
)

# --- Engine state ---
ENGINE_UNFINISHED_REQUESTS = Gauge(
    "sluice_engine_unfinished_requests",
    "Requests the engine holds (running or waiting inside the engine), read at scrape time.",
    ["model"],
    registry=REGISTRY,
)
ENGINE_HEALTHY = Gauge(
    "sluice_engine_healthy",
    "1 while the engine is loaded and healthy, else 0.",
    ["model"],
    registry=REGISTRY,
)
ENGINE_ABORTS = Counter(
    "sluice_engine_aborts",
    "Engine requests aborted by Sluice before they finished, by reason.",
    ["model", "reason"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "sluice_cancellations",
    "Requests whose client left or cancelled, by where they were (queued or running).",
    ["model", "traffic_class", "stage"],
    registry=REGISTRY,
)

# --- Scheduler state (recorded at state changes by the scheduler shell) ---
QUEUE_DEPTH = Gauge(
    "sluice_queue_depth",
    "Requests waiting in Sluice's queue.",
    ["model", "traffic_class"],
    registry=REGISTRY,
)
QUEUE_OLDEST_AGE = Gauge(
    "sluice_queue_oldest_age_seconds",
    "Age of the oldest queued request.",
    ["model", "traffic_class"],
    registry=REGISTRY,
)
RUNNING_REQUESTS = Gauge(
    "sluice_running_requests",
    "Sequences dispatched to the engine and not yet ended (a request with n choices runs n).",
    ["model", "traffic_class"],
    registry=REGISTRY,
)
BUDGET_IN_USE = Gauge(
    "sluice_budget_in_use",
    "Units of each budget held by running requests.",
    ["budget"],
    registry=REGISTRY,
)
BUDGET_LIMIT = Gauge(
    "sluice_budget_limit",
    "Limit of each budget.",
    ["budget"],
    registry=REGISTRY,
)
REJECTIONS = Counter(
    "sluice_rejections",
    "Requests refused before or instead of dispatch, by reason.",
    ["model", "traffic_class", "reason", "tenant"],
    registry=REGISTRY,
)
DEADLINE_MISSES = Counter(
    "sluice_deadline_misses",
    "Requests whose deadline passed before they completed (expired queued or aborted running).",
    ["model", "traffic_class"],
    registry=REGISTRY,
)
TENANT_REQUESTS = Counter(
    "sluice_tenant_requests",
    "Requests that ended, by configured tenant and outcome.",
    ["tenant", "outcome"],
    registry=REGISTRY,
)
AUTOSCALE_PRESSURE = Gauge(
    "sluice_autoscale_pressure",
    "Predicted queue wait over the class's deadline budget; above 1 means add capacity.",
    ["model", "traffic_class"],
    registry=REGISTRY,
)

# --- Interactive SLO and the bulk cap ---
SLO_REQUESTS = Counter(
    "sluice_slo_requests",
    "Requests that ended, by whether they met their class's service-level objective "
    "(interactive: completed within the TTFT and median inter-token targets; bulk: completed).",
    ["model", "traffic_class", "result", "reason"],
    registry=REGISTRY,
)
SLO_TARGET = Gauge(
    "sluice_slo_target_seconds",
    "The interactive targets in effect: time to first token (ttft) and median gap between "
    "tokens (itl).",
    ["model", "traffic_class", "target"],
    registry=REGISTRY,
)
BULK_CAP = Gauge(
    "sluice_bulk_cap_sequences",
    "Bulk sequences allowed to run now (lower while chats run, the knee otherwise).",
    ["model"],
    registry=REGISTRY,
)
RESUMED_PREFILL_TOKENS = Counter(
    "sluice_resumed_prefill_tokens",
    "Prompt tokens the engine computed again to resume preempted requests (the rest of each "
    'resumed prompt came from its prefix cache); with engine_aborts_total{reason="preempted"}, '
    "what a pause costs.",
    ["model"],
    registry=REGISTRY,
)
KNEE = Gauge(
    "sluice_knee_sequences",
    "Learned concurrency past which more sequences add little throughput.",
    ["model"],
    registry=REGISTRY,
)

# --- Batch dispatch mode ---
BATCH_SIZE = Histogram(
    "sluice_batch_size",
    "Requests per dispatched batch.",
    ["model"],
    buckets=(1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 128),
    registry=REGISTRY,
)
WORKER_FAILURES = Counter(
    "sluice_worker_failures",
    "Batches lost to a worker failure.",
    ["model"],
    registry=REGISTRY,
)
BATCH_RETRIES = Counter(
    "sluice_batch_retries",
    "Requests re-queued after their batch failed.",
    ["model"],
    registry=REGISTRY,
)


# --- Shared state (Redis), with `state.url` set ---
_STATE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
)
STATE_UP = Gauge(
    "sluice_state_backend_up",
    "1 while the shared state backend answers; 0 while this replica enforces its share of "
    "each tenant limit alone.",
    ["backend"],
    registry=REGISTRY,
)
STATE_LATENCY = Histogram(
    "sluice_state_backend_seconds",
    "Round trips to the shared state backend, by operation.",
    ["operation"],
    buckets=_STATE_BUCKETS,
    registry=REGISTRY,
)
STATE_ERRORS = Counter(
    "sluice_state_backend_errors_total",
    "Calls to the shared state backend that failed or timed out, by operation.",
    ["operation"],
    registry=REGISTRY,
)
STATE_REPLICAS = Gauge(
    "sluice_state_replicas",
    "Replicas the shared state backend last counted (those renewing their leases).",
    ["backend"],
    registry=REGISTRY,
)
STATE_TAKEOVERS = Counter(
    "sluice_state_takeovers",
    "Resumable generations this replica took over from a replica that stopped renewing its "
    "lease (it died), by how: continued from the logged tokens, or started afresh (nothing "
    "was sent yet).",
    ["how"],
    registry=REGISTRY,
)
STATE_OPERATIONS = ("acquire", "release", "renew", "open", "find", "append", "claim", "read")


def initialise(model: str, tenant_labels: tuple[str, ...] = ()) -> None:
    """Create every labelled counter's series for `model` at zero (Prometheus' guidance: a
    series that appears only with its first event leaves gaps in rates and alerts)."""
    for outcome in BATCH_LINE_OUTCOMES:
        BATCH_LINES.labels(outcome)
    for tc in TRAFFIC_CLASSES:
        for outcome in OUTCOMES:
            REQUESTS.labels(model, tc, outcome)
        for reason in REJECTION_REASONS:
            for tenant in (*tenant_labels, "other"):
                REJECTIONS.labels(model, tc, reason, tenant)
        for stage in CANCEL_STAGES:
            CANCELLATIONS.labels(model, tc, stage)
        for result, reason in SLO_RESULTS[tc]:
            SLO_REQUESTS.labels(model, tc, result, reason)
        DEADLINE_MISSES.labels(model, tc)
        GENERATED_TOKENS.labels(model, tc)
        PROMPT_TOKENS.labels(model, tc)
    for reason in ABORT_REASONS:
        ENGINE_ABORTS.labels(model, reason)
    for tenant in tenant_labels:
        for outcome in OUTCOMES:
            TENANT_REQUESTS.labels(tenant, outcome)
    RESUMED_PREFILL_TOKENS.labels(model)
    WORKER_FAILURES.labels(model)
    BATCH_RETRIES.labels(model)
