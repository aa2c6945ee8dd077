"""Every Prometheus metric Sluice exports, in one place.

Naming follows Prometheus conventions: `sluice_` prefix, base units with `_seconds`, counters
end in `_total`. Label sets are bounded: model (served names), traffic_class (two values),
outcome/reason/budget (fixed vocabularies), tenant (configured tenants only, counters only).
docs/operations.md ("Metrics") defines each one precisely. Beside them, vLLM's own series
(`vllm:*`, `server/observability/vllm_series.py`), as vLLM's server names them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine_adapters.protocol import EngineClient
from server.core.errors import OUTCOMES, REJECTION_CODES, TRANSIENT_CODES
from server.observability.counters import CounterReadAtScrape
from server.observability.histograms import BatchedChild, BatchedHistogram, BatchedPair
from server.observability.vllm_series import VllmSeries


def _by_decade(*decades: tuple[float, ...]) -> tuple[float, ...]:
    """A histogram's bucket bounds, written a decade a row."""
    return tuple(bound for decade in decades for bound in decade)


_LATENCY_BUCKETS = _by_decade(
    (0.005,),
    (0.01, 0.025, 0.05, 0.075),
    (0.1, 0.15, 0.2, 0.3, 0.5, 0.75),
    (1.0, 1.5, 2.0, 3.0, 5.0, 7.5),
    (10.0, 20.0, 30.0, 60.0),
)
_ITL_BUCKETS = _by_decade(
    (0.001, 0.0025, 0.005, 0.0075),
    (0.01, 0.015, 0.02, 0.03, 0.05, 0.075),
    (0.1, 0.15, 0.2, 0.3, 0.5),
    (1.0, 2.0),
)
_DURATION_BUCKETS = _by_decade(
    (0.05,),
    (0.1, 0.25, 0.5),
    (1.0, 2.0, 3.0, 5.0, 7.5),
    (10.0, 15.0, 20.0, 30.0, 60.0),
    (120.0, 300.0),
)

# The label values known in advance, each labelled counter's vocabulary: `initialise` creates
# every series at zero, so dashboards and alerts see 0 rather than nothing before the first event.
# Outcomes and rejection reasons are the error classes' own (server/core/errors.py).
TRAFFIC_CLASSES = ("interactive", "bulk")
CANCEL_STAGES = ("queued", "running")
ABORT_REASONS = ("client_cancelled", "deadline", "preempted")
# sluice_slo_requests_total{result, reason}: met requests have reason "none"; a miss names the
# first promise broken. Bulk misses a latency target only where `slo.bulk` sets one.
_SLO_VERDICTS = (
    ("met", "none"),
    ("missed", "ttft"),
    ("missed", "itl"),
    ("missed", "refused"),
    ("missed", "expired"),
    ("missed", "failed"),
)
SLO_RESULTS: dict[str, tuple[tuple[str, str], ...]] = {
    "interactive": _SLO_VERDICTS,
    "bulk": _SLO_VERDICTS,
}

BATCH_LINE_OUTCOMES = ("completed", "failed", "expired")
# sluice_ignored_fields_total{api, field}: the APIs whose bodies may hold fields that change
# nothing; `field` is a field the API's models declare so (`initialise` is told them), else
# "other" (undeclared names are the clients' to choose: unbounded).
IGNORED_FIELD_APIS = (
    "chat",
    "completions",
    "responses",
    "conversations",
    "messages",
    "tokenizer",
    "batches",
    "adapters",
)
OTHER_FIELD = "other"
# sluice_unmatched_requests_total{method, status}: a method outside HTTP_METHODS is "other".
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other")
UNMATCHED_STATUSES = ("404", "405")

_STATE_BUCKETS = _by_decade(
    (0.0001, 0.00025, 0.0005, 0.00075),
    (0.001, 0.0015, 0.002, 0.003, 0.005),
    (0.01, 0.025, 0.05),
    (0.1, 0.25, 0.5),
)
STATE_OPERATIONS = (
    "acquire",
    "release",
    "renew",
    "open",
    "find",
    "append",
    "claim",
    "read",
    "batches",
    "conversations",
    "keep",
    "adapters",
)


_BY_CLASS = ("model", "traffic_class")
# The model label of a request for a model the server does not serve: the label's values are
# the served model, its adapters, and this.
OTHER_MODEL = "other"


class Metrics:
    """Every Prometheus metric one Sluice app exports, in a registry of its own: the
    composition root makes one per app and hands it to each part that records, so that two
    apps in one process (tests) never see each other's counts."""

    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry(auto_describe=True)
        self._series: dict[tuple[str, str], RequestSeries] = {}
        self.vllm: VllmSeries | None = None  # once the engine has started (`vllm_series`)
        counter = partial(Counter, registry=registry)
        gauge = partial(Gauge, registry=registry)
        histogram = partial(Histogram, registry=registry)
        # --- Per-request timings (recorded by the server as bytes reach the client) ---
        self.time_to_first_token = histogram(
            "sluice_time_to_first_token_seconds",
            "Arrival at the server to the first generated token written to the client.",
            _BY_CLASS,
            buckets=_LATENCY_BUCKETS,
        )
        # Flushed a stream's second of gaps at a time (hundreds of values in one call).
        self.inter_token_latency = BatchedHistogram(
            "sluice_inter_token_latency_seconds",
            "Gap between consecutive writes of generated tokens to the client, divided evenly "
            "among the tokens of the later write.",
            _BY_CLASS,
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.stream_median_gap = histogram(
            "sluice_stream_median_gap_seconds",
            "Each stream's median gap between chunks written to the client (as its reader waits "
            "them), observed once as it ends: the figure an inter-token target judges.",
            _BY_CLASS,
            buckets=_ITL_BUCKETS,
        )
        self.request_duration = histogram(
            "sluice_request_duration_seconds",
            "Arrival at the server to the last byte of the response written.",
            _BY_CLASS,
            buckets=_DURATION_BUCKETS,
        )
        self.queue_wait = histogram(
            "sluice_queue_wait_seconds",
            "Arrival at the server to dispatch into the engine.",
            _BY_CLASS,
            buckets=_LATENCY_BUCKETS,
        )
        self.batches = gauge("sluice_batches", "Batches (the Batch API) by status.", ["status"])
        self.batch_lines = counter(
            "sluice_batch_lines",
            "Batch lines that ended: completed, failed (an error response) or expired.",
            ["outcome"],
        )
        self.batch_line_retries = counter(
            "sluice_batch_line_retries",
            "Batch lines refused for now and offered again later, by the refusal's code: a "
            "capacity or quota refusal, or their conversation held by another response.",
            ["code"],
        )
        self.requests = counter(
            "sluice_requests", "Requests that ended, by outcome.", [*_BY_CLASS, "outcome"]
        )
        self.ignored_fields = counter(
            "sluice_ignored_fields",
            "Fields of request bodies accepted and ignored (they change nothing Sluice answers, "
            "as vLLM's server ignores them), by API and field: one a field of vLLM's or SGLang's "
            "that Sluice declares, else other.",
            ["api", "field"],
        )
        self._ignorable: dict[str, frozenset[str]] = {}
        self.unmatched_requests = counter(
            "sluice_unmatched_requests",
            "HTTP requests no route serves: an unknown path (404) or method (405).",
            ["method", "status"],
        )
        self.generated_tokens = counter(
            "sluice_generated_tokens", "Tokens the engine generated and Sluice received.", _BY_CLASS
        )
        self.prompt_tokens = counter(
            "sluice_prompt_tokens", "Prompt tokens of requests dispatched to the engine.", _BY_CLASS
        )

        # --- Engine state ---
        self.engine_unfinished_requests = gauge(
            "sluice_engine_unfinished_requests",
            "Requests the engine holds (running or waiting inside the engine), read at scrape "
            "time.",
            ["model"],
        )
        self.engine_healthy = gauge(
            "sluice_engine_healthy", "1 while the engine is loaded and healthy, else 0.", ["model"]
        )
        self.engine_aborts = counter(
            "sluice_engine_aborts",
            "Engine requests aborted by Sluice before they finished, by reason.",
            ["model", "reason"],
        )
        self.cancellations = counter(
            "sluice_cancellations",
            "Requests whose client left or cancelled, by where they were (queued or running).",
            [*_BY_CLASS, "stage"],
        )

        # --- Scheduler state (recorded at state changes by the scheduler shell) ---
        self.queue_depth = gauge(
            "sluice_queue_depth", "Requests waiting in Sluice's queue.", _BY_CLASS
        )
        self.queue_oldest_age = gauge(
            "sluice_queue_oldest_age_seconds", "Age of the oldest queued request.", _BY_CLASS
        )
        self.running_requests = gauge(
            "sluice_running_requests",
            "Sequences dispatched to the engine and not yet ended (a request with n choices runs "
            "n).",
            _BY_CLASS,
        )
        self.budget_in_use = gauge(
            "sluice_budget_in_use", "Units of each budget held by running requests.", ["budget"]
        )
        self.budget_limit = gauge("sluice_budget_limit", "Limit of each budget.", ["budget"])
        self.rejections = counter(
            "sluice_rejections",
            "Requests refused before or instead of dispatch, by reason.",
            [*_BY_CLASS, "reason", "tenant"],
        )
        self.class_downgrades = CounterReadAtScrape(
            "sluice_traffic_class_downgrades_total",
            "Requests that asked for a traffic class their tenant may not use, served in the "
            "tenant's default class instead, by tenant and the class asked for.",
            ["tenant", "asked"],
            registry=registry,
        )
        self.deadline_misses = counter(
            "sluice_deadline_misses",
            "Requests whose deadline passed before they completed (expired queued or aborted "
            "running).",
            _BY_CLASS,
        )
        self.tenant_requests = counter(
            "sluice_tenant_requests",
            "Requests that ended, by configured tenant and outcome.",
            ["tenant", "outcome"],
        )
        self.autoscale_pressure = gauge(
            "sluice_autoscale_pressure",
            "Predicted queue wait over the class's deadline budget; above 1 means add capacity.",
            _BY_CLASS,
        )

        # --- Interactive SLO and the bulk cap ---
        self.slo_requests = counter(
            "sluice_slo_requests",
            "Requests that ended, by whether they met their class's service-level objective "
            "(interactive: completed within the TTFT and median inter-token targets; bulk: "
            "completed).",
            [*_BY_CLASS, "result", "reason"],
        )
        self.slo_target = gauge(
            "sluice_slo_target_seconds",
            "The class's targets in effect: time to first token (ttft) and median gap between "
            "tokens (itl); a tenant's own targets may differ.",
            [*_BY_CLASS, "target"],
        )
        self.bulk_cap = gauge(
            "sluice_bulk_cap_sequences",
            "Bulk sequences allowed to run now (lower while chats run, the knee otherwise).",
            ["model"],
        )
        self.chat_gap_share = gauge(
            "sluice_chat_gap_share",
            "The median gap between interactive tokens written in the last second, as a share "
            "of their targets (1: on target), as the bulk controller reads it (NaN: too few).",
            ["model"],
        )
        self.controller_scale = gauge(
            "sluice_bulk_controller_scale",
            "The bulk controller's correction of the step-time model: the cap's step budgets are "
            "multiplied by it (below 1: chats get slower gaps than the model predicts).",
            ["model"],
        )
        self.controller_aim = gauge(
            "sluice_bulk_controller_aim",
            "The median gap share the controller holds chats at, learned so that "
            "slo.attainment_goal of chats keep their targets.",
            ["model"],
        )
        self.controller_aim_limit = gauge(
            "sluice_bulk_controller_aim_limit",
            "What limits the aim, by source: spread (the aim that the last chats' spread around "
            "it leaves slo.attainment_goal of them within their targets) and misses (the ceiling "
            "that chats over their gap target lower and chats within it raise). The aim is the "
            "lower of the two.",
            ["model", "source"],
        )
        self.controller_pace = gauge(
            "sluice_bulk_controller_pace",
            "The speed at which bulk may start (at most 1), slowed when chats' first tokens are "
            "late behind bulk's prefills in the engine.",
            ["model"],
        )
        self.bulk_preemptions = CounterReadAtScrape(
            "sluice_bulk_preemptions_total",
            "Running bulk requests the scheduler named to stop (each resumes later), by cause: "
            "chats_far_over (bulk over its cap while chats measure far over their gap target), "
            "step_over_target (bulk over its cap and a step predicted far over the target), "
            "chat_burst (bulk over its cap while more chats run than usually do), "
            "waiting_chat (a chat waited preempt_bulk_after_s with no budget room), "
            "adapter_slot (a chat on a LoRA adapter waited for a slot only bulk held).",
            ["model", "cause"],
            registry=registry,
        )
        self.resumed_prefill_tokens = counter(
            "sluice_resumed_prefill_tokens",
            "Prompt tokens the engine computed again to resume preempted requests (the rest of "
            "each resumed prompt came from its prefix cache); with "
            'engine_aborts_total{reason="preempted"}, what a pause costs.',
            ["model"],
        )
        self.knee = gauge(
            "sluice_knee_sequences",
            "Learned concurrency past which more sequences add little throughput.",
            ["model"],
        )

        # --- Batch dispatch mode ---
        self.batch_size = histogram(
            "sluice_batch_size",
            "Requests per dispatched batch.",
            ["model"],
            buckets=(1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 128),
        )
        self.worker_failures = counter(
            "sluice_worker_failures", "Batches lost to a worker failure.", ["model"]
        )
        self.batch_retries = counter(
            "sluice_batch_retries", "Requests re-queued after their batch failed.", ["model"]
        )

        # --- Shared state (Redis), with `state.url` set ---
        self.state_up = gauge(
            "sluice_state_backend_up",
            "1 while the shared state backend answers; 0 while this replica enforces its share of "
            "each tenant limit alone.",
            ["backend"],
        )
        self.state_latency = histogram(
            "sluice_state_backend_seconds",
            "Round trips to the shared state backend, by operation.",
            ["operation"],
            buckets=_STATE_BUCKETS,
        )
        self.state_errors = counter(
            "sluice_state_backend_errors_total",
            "Calls to the shared state backend that failed or timed out, by operation.",
            ["operation"],
        )
        self.state_replicas = gauge(
            "sluice_state_replicas",
            "Replicas the shared state backend last counted (those renewing their leases).",
            ["backend"],
        )
        self.state_takeovers = counter(
            "sluice_state_takeovers",
            "Resumable generations this replica took over from a replica that stopped renewing its "
            "lease (it died), by how: continued from the logged tokens, or started afresh (nothing "
            "was sent yet).",
            ["how"],
        )

    def series(self, model: str, traffic_class: str) -> RequestSeries:
        """The per-request series of one model and traffic class, looked up once (a
        `labels` call costs a lock and a tuple each; a request records about eight)."""
        key = (model, traffic_class)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = RequestSeries.bind(self, model, traffic_class)
        return found

    def count_ignored(self, api: str, fields: Iterable[str]) -> None:
        """Count a request's ignored fields (by their paths, `stream_options.x`)."""
        known = self._ignorable.get(api, frozenset())
        for field in fields:
            self.ignored_fields.labels(api, field if field in known else OTHER_FIELD).inc()

    def vllm_series(self, model: str, engine: EngineClient, queued: Callable[[], int]) -> None:
        """vLLM's series for the served `model`, at zero, once its `engine` has started (and
        the scheduler, whose queues `queued` counts): the requests that reach the engine from
        now on record into them too."""
        self.vllm = VllmSeries(self.registry, model, engine, queued)
        self._series.clear()  # (bound again, with them)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, for a scrape."""
        return generate_latest(self.registry)

    def initialise(
        self,
        model: str,
        tenant_labels: tuple[str, ...] = (),
        ignorable: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        """Create every labelled counter's series for `model` at zero (Prometheus' guidance: a
        series that appears only with its first event leaves gaps in rates and alerts).
        `ignorable`: by API (`IGNORED_FIELD_APIS`), the fields its bodies declare to change
        nothing, each counted by its name when sent (any other by "other")."""
        self._ignorable = dict(ignorable or {})
        for api in IGNORED_FIELD_APIS:
            for field in (*sorted(self._ignorable.get(api, ())), OTHER_FIELD):
                self.ignored_fields.labels(api, field)
        for outcome in BATCH_LINE_OUTCOMES:
            self.batch_lines.labels(outcome)
        for code in TRANSIENT_CODES:
            self.batch_line_retries.labels(code)
        for method in HTTP_METHODS:
            for status in UNMATCHED_STATUSES:
                self.unmatched_requests.labels(method, status)
        for tc in TRAFFIC_CLASSES:
            for outcome in OUTCOMES:
                self.requests.labels(model, tc, outcome)
            for reason in REJECTION_CODES:
                for tenant in (*tenant_labels, "other"):
                    self.rejections.labels(model, tc, reason, tenant)
            for stage in CANCEL_STAGES:
                self.cancellations.labels(model, tc, stage)
            for result, reason in SLO_RESULTS[tc]:
                self.slo_requests.labels(model, tc, result, reason)
            self.deadline_misses.labels(model, tc)
            self.generated_tokens.labels(model, tc)
            self.prompt_tokens.labels(model, tc)
        for reason in ABORT_REASONS:
            self.engine_aborts.labels(model, reason)
        for tenant in tenant_labels:
            for outcome in OUTCOMES:
                self.tenant_requests.labels(tenant, outcome)
        self.resumed_prefill_tokens.labels(model)
        self.worker_failures.labels(model)
        self.batch_retries.labels(model)


@dataclass(frozen=True, slots=True)
class ClassGauges:
    """The scheduler's gauges of one model and traffic class, looked up once by the shell
    that sets them at every state change."""

    queue_depth: Gauge
    queue_oldest_age: Gauge
    running_requests: Gauge
    autoscale_pressure: Gauge

    @classmethod
    def bind(cls, metrics: Metrics, model: str, traffic_class: str) -> ClassGauges:
        return cls(
            metrics.queue_depth.labels(model, traffic_class),
            metrics.queue_oldest_age.labels(model, traffic_class),
            metrics.running_requests.labels(model, traffic_class),
            metrics.autoscale_pressure.labels(model, traffic_class),
        )


@dataclass(frozen=True, slots=True)
class RequestSeries:
    """The series one request records into, for its model and traffic class (`series`)."""

    queue_wait: Histogram
    prompt_tokens: Counter
    time_to_first_token: Histogram
    generated_tokens: Counter
    # Sluice's, and with vLLM's series vLLM's too, counted in one pass.
    inter_token_latency: BatchedChild | BatchedPair
    request_duration: Histogram
    stream_median_gap: Histogram
    requests: dict[str, Counter]  # by outcome
    vllm: VllmSeries | None  # vLLM's series, once the engine has started

    @classmethod
    def bind(cls, metrics: Metrics, model: str, traffic_class: str) -> RequestSeries:
        labels = (model, traffic_class)
        vllm = metrics.vllm
        itl = metrics.inter_token_latency.labels(*labels)
        return cls(
            metrics.queue_wait.labels(*labels),
            metrics.prompt_tokens.labels(*labels),
            metrics.time_to_first_token.labels(*labels),
            metrics.generated_tokens.labels(*labels),
            itl if vllm is None else BatchedPair(itl, vllm.inter_token_latency),
            metrics.request_duration.labels(*labels),
            metrics.stream_median_gap.labels(*labels),
            {outcome: metrics.requests.labels(*labels, outcome) for outcome in OUTCOMES},
            vllm,
        )
