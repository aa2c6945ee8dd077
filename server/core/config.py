"""Sluice's configuration, declared once: tenants and their API keys, per-class limits,
scheduler budgets, estimates, SLO targets, resumption, shared state and tracing.

Each setting is one field: its name (with its unit: `_ms`, `_seconds`, `_s`), its default, its
bounds and its help. The YAML file, the environment and the flags (`server.core.settings`)
fill the same fields; `parse_config` checks the result strictly, and every `ConfigError` names
the path of what it refuses (`tenants.acme.max_concurent: unknown key; did you mean
max_concurrent?`). Durations the file gives in milliseconds are read in seconds through a
property (`deadline_ms` -> `deadline_s`), so the unit is in every name.

This module reads no file and no environment: the scheduler's core takes these models as
plain values.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.core.messages import describe

OPEN_TENANT = "default"
API_KEYS_ENV = "SLUICE_API_KEYS"


class ConfigError(ValueError):
    """The configuration file, environment or flags are malformed."""


class TrafficClass(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


def _number(value: Any) -> Any:
    """Refuse a boolean where a number is meant (pydantic would read True as 1)."""
    if isinstance(value, bool):
        raise PydanticCustomError("not_a_number", "expected a number")
    return value


Positive = Annotated[float, BeforeValidator(_number), Field(gt=0)]
PositiveWhole = Annotated[int, BeforeValidator(_number), Field(gt=0)]
NonNegative = Annotated[float, BeforeValidator(_number), Field(ge=0)]
Share = Annotated[float, BeforeValidator(_number), Field(ge=0, lt=1)]  # [0, 1)
Fraction = Annotated[float, BeforeValidator(_number), Field(gt=0, le=1)]  # (0, 1]


class _Section(BaseModel):
    """A mapping of the configuration: unknown keys refused, frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_DIGEST = re.compile(r"[0-9a-f]{64}")


class ClassSlo(_Section):
    """A class's latency targets (or a tenant's, for its chats): stated in milliseconds, or
    derived from the engine when nearly idle (interactive only)."""

    ttft_ms: Positive | None = Field(
        None, description="time to first token (p99); null: ttft_factor x the idle one"
    )
    itl_ms: Positive | None = Field(
        None,
        description="median gap between a stream's tokens; null: itl_factor x the idle one "
        "(one step)",
    )

    @property
    def ttft_s(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms / 1000.0

    @property
    def itl_s(self) -> float | None:
        return None if self.itl_ms is None else self.itl_ms / 1000.0


class TenantConfig(_Section):
    name: str = Field(description="the tenant's name: its key under `tenants`")
    api_keys: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        (), description="the tenant's API keys, in plain text"
    )
    api_key_sha256: tuple[str, ...] = Field(
        (), description="the tenant's API keys kept only as SHA-256 digests (hex)"
    )
    max_concurrent: PositiveWhole | None = Field(
        None, description="queued + running requests at once; null: no limit"
    )
    tokens_per_minute: PositiveWhole | None = Field(
        None, description="prompt + max_tokens admitted per rolling minute; null: no limit"
    )
    allowed_classes: frozenset[TrafficClass] = Field(
        frozenset(TrafficClass), min_length=1, description="traffic classes the tenant may use"
    )
    default_class: TrafficClass = Field(
        None,  # type: ignore[assignment]  # filled in by _default_class
        validate_default=True,
        description="class of a request that asks for none (default: interactive if allowed)",
    )
    slo: ClassSlo | None = Field(
        None,
        description="the tenant's own interactive targets, each over slo.interactive's "
        "(null: the class's)",
    )
    models: tuple[Annotated[str, Field(min_length=1)], ...] | None = Field(
        None,
        min_length=1,
        description="the models the tenant may use: the served model's name, adapters' names "
        "(null: every one served)",
    )
    default_model: str | None = Field(
        None,
        validate_default=True,
        description="the model of a request that names none (default: the first of models, "
        "else the served model)",
    )
    admin: bool = Field(
        False,
        description="the tenant's keys may also load and unload LoRA adapters "
        "(/v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    prefix_cache: Literal["own", "shared"] = Field(
        "own",
        description="own: the engine's prefix cache reuses a prompt's blocks only for this "
        "tenant's later prompts (a cache salt of its own), so another tenant cannot learn from "
        "how fast its answer starts whether this one sent the same text; shared: with every "
        "other tenant whose cache is shared too",
    )

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, digests: tuple[str, ...]) -> tuple[str, ...]:
        for digest in digests:
            if not _DIGEST.fullmatch(digest.lower()):
                raise ValueError(f"{digest[:12]}… is not a SHA-256 digest (64 hex digits)")
        return tuple(d.lower() for d in digests)

    @field_validator("default_model")
    @classmethod
    def _default_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        models = info.data.get("models")
        if value is None:
            return None if not models else models[0]
        if models is not None and value not in models:
            raise ValueError(f"{value} is not in models")
        return value

    @field_validator("default_class", mode="before")
    @classmethod
    def _default_class(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = info.data.get("allowed_classes")
        if value is None and allowed:
            return TrafficClass.INTERACTIVE if TrafficClass.INTERACTIVE in allowed else "bulk"
        return value

    @field_validator("default_class")
    @classmethod
    def _default_is_allowed(cls, value: TrafficClass, info: ValidationInfo) -> TrafficClass:
        allowed = info.data.get("allowed_classes")
        if allowed is not None and value not in allowed:
            raise ValueError(f"{value} is not in allowed_classes")
        return value


class ClassConfig(_Section):
    deadline_ms: Positive = Field(
        description="deadline of a request that carries no X-Request-Timeout-Ms"
    )
    max_queued: PositiveWhole = Field(description="requests waiting, per model")
    max_queued_tokens: PositiveWhole = Field(
        description="prompt + max_tokens of requests waiting, per model"
    )
    tenant_queue_share: Fraction = Field(
        0.5, description="most of max_queued one tenant may hold (with more than one tenant)"
    )

    @property
    def deadline_s(self) -> float:
        return self.deadline_ms / 1000.0


_CLASS_DEFAULTS: dict[TrafficClass, dict[str, Any]] = {
    TrafficClass.INTERACTIVE: {
        "deadline_ms": 30_000.0,
        "max_queued": 256,
        "max_queued_tokens": 256 * 2048,
    },
    TrafficClass.BULK: {
        "deadline_ms": 600_000.0,
        "max_queued": 1024,
        "max_queued_tokens": 1024 * 4096,
    },
}


def _default_classes() -> dict[TrafficClass, ClassConfig]:
    return {c: ClassConfig(**values) for c, values in _CLASS_DEFAULTS.items()}


class BudgetConfig(_Section):
    kv_target_utilization: Fraction = Field(
        0.9, description="share of the engine's KV blocks Sluice may reserve"
    )
    interactive_reserve_share: Share = Field(
        0.2, description="share of each budget bulk may never take"
    )
    bulk_min_share: Share = Field(
        0.1, description="share of each budget bulk is guaranteed while waiting"
    )
    max_running_seqs: PositiveWhole = Field(256, description="sequences running at once")
    max_running_tokens: PositiveWhole | None = Field(
        None, description="tokens reserved by running sequences; null: the KV-cache budget"
    )
    fairness_quantum_tokens: PositiveWhole = Field(
        1024, description="credit per fair-queueing turn; smaller: finer interleaving"
    )
    preempt_bulk_after_ms: NonNegative | None = Field(
        500.0,
        description="a chat queued this long with no room, even in its reserve, stops running "
        "bulk work (requeued as a continuation); null: never preempt",
    )

    @field_validator("bulk_min_share")
    @classmethod
    def _fits_beside_reserve(cls, bulk_min: float, info: ValidationInfo) -> float:
        reserve = info.data.get("interactive_reserve_share")
        if reserve is not None and bulk_min > 1.0 - reserve:
            raise ValueError("exceeds what the interactive reserve leaves")
        return bulk_min

    @property
    def preempt_bulk_after_s(self) -> float | None:
        after = self.preempt_bulk_after_ms
        return None if after is None else after / 1000.0


class EstimateConfig(_Section):
    """Priors for the online rate estimates, used until the engine has been observed."""

    prefill_tokens_per_s: Positive = 20_000.0
    decode_tokens_per_s: Positive = Field(100.0, description="per running sequence")
    open_ended_output_tokens: Positive = Field(
        256.0,
        description="tokens an answer without max_tokens is expected to produce (it reserves "
        "the whole context in the budgets, but admission judges its completion time by this)",
    )
    admission_margin: Share = Field(
        0.1,
        description="share of a request's predicted time to completion kept as a margin for "
        "the estimate's error (an unbiased estimate alone, at the edge of a full queue, admits "
        "requests of which about half then miss their deadline)",
    )
    smoothing: Share = Field(0.2, description="weight of each new observation in the average")
    calibrate: bool = Field(
        True,
        description="measure the engine at start-up (step time at several concurrencies, idle "
        "time to first token) instead of starting from the priors",
    )


class SloConfig(_Section):
    """The classes' targets, and how bulk makes room for the interactive one.

    Interactive targets default to a multiple of what the engine shows when nearly idle, so
    they suit any hardware; a setting in milliseconds overrides them. Bulk has none unless
    set: its targets are measured and reported, never steered for."""

    interactive: ClassSlo = ClassSlo()
    bulk: ClassSlo = ClassSlo()
    ttft_factor: Positive = 3.0
    itl_factor: Positive = 3.0
    cap_bulk: bool = Field(
        True,
        description="cap running bulk so that, while chats run, they keep their targets; "
        "false: bulk runs up to its budgets",
    )
    feedback: bool = Field(
        True,
        description="steer the bulk cap by what chats measured (the step-time model is its "
        "starting point); false: by the model alone",
    )
    bulk_cap_sequences: PositiveWhole | None = Field(
        None,
        description="a fixed cap: bulk never runs more sequences than this; null: the "
        "controller sets the cap",
    )
    attainment_goal: Fraction = Field(
        0.97,
        description="share of chats the controller keeps within their targets; the rest of "
        "the engine goes to bulk",
    )
    bulk_hold_ms: NonNegative = Field(
        1000.0,
        description="bulk stays capped this long after the last chat ends, and while chats "
        "arrive more often than once in this long (their rate over the last 10 s), so a "
        "stream of chats does not make bulk pay for a preemption each",
    )
    knee_share: Fraction = Field(
        0.95,
        description="with no chat about, bulk runs at the fewest sequences that reach this "
        "share of the best tokens/s seen (the knee)",
    )

    @property
    def ttft_s(self) -> float | None:
        return self.interactive.ttft_s

    @property
    def itl_s(self) -> float | None:
        return self.interactive.itl_s

    @property
    def bulk_hold_s(self) -> float:
        return self.bulk_hold_ms / 1000.0


class ResumeConfig(_Section):
    """Generations that outlive their connection (sent with an idempotency key)."""

    grace_seconds: Positive = Field(30.0, description="a running generation's life unread")


class IdempotencyConfig(_Section):
    retention_seconds: Positive = Field(
        86_400.0, description="how long an ended generation can be replayed"
    )
    max_bytes: PositiveWhole = Field(
        256 << 20, description="all event logs together; the oldest ended go first"
    )


class ResponsesConfig(_Section):
    """The Responses API's stored responses: in Redis with `state.url` (any replica finds
    them), else in SQLite under the data directory (they outlive the process)."""

    retention_seconds: Positive = Field(
        2_592_000.0, description="how long an ended response is kept (30 days)"
    )
    max_bytes: PositiveWhole = Field(
        256 << 20, description="each tenant's stored responses together; the oldest go first"
    )


class ConversationsConfig(_Section):
    """The Conversations API's conversations, kept until deleted: in Redis with `state.url`
    (any replica finds them), else in SQLite under the data directory. Each bound is
    checked when items are added (a conversation made or given items, a response's input at
    its start), and one passed is a 4xx that changes nothing."""

    max_conversations: PositiveWhole = Field(10_000, description="each tenant's conversations")
    max_items: PositiveWhole = Field(
        1_000_000, description="each tenant's items, in all its conversations together"
    )
    max_item_bytes: PositiveWhole = Field(
        1 << 20, description="one item added by a client, as JSON (a response's output is not)"
    )


class StateConfig(_Section):
    """Where state shared by replicas lives. `url` null: in this process only, as with one
    replica. With a Redis URL, tenant quotas hold across every replica using it, and
    resumable generations can be retried, resumed and taken over on any of them."""

    url: str | None = Field(None, description="redis://, rediss:// or unix:// URL")
    lease_seconds: Positive = Field(
        10.0,
        description="a replica renews what it holds (quota slots, generations, batches, "
        "conversations held by a response) every third of this; a dead one's holdings expire "
        "this long after",
    )
    timeout_ms: Positive = Field(
        250.0, description="a call slower than this counts as Redis being unavailable"
    )
    replicas: PositiveWhole = Field(
        1,
        description="with Redis unavailable, each replica enforces 1/replicas of every "
        "tenant's limits: the replicas Redis last counted, or this until it has counted any",
    )

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {url!r}")
        return url

    @property
    def lease_s(self) -> float:
        return self.lease_seconds

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0


class TracingConfig(_Section):
    """OpenTelemetry traces: a span per request, sent over OTLP (docs/observability.md,
    "Traces"). The exporter's other settings are the standard `OTEL_*` variables."""

    otlp_traces_endpoint: str | None = Field(
        None,
        description="where spans are sent, as vLLM's --otlp-traces-endpoint: a gRPC "
        "host:port or URL, or with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf a URL "
        "ending in /v1/traces; null: no tracing",
    )

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.strip():
            raise ValueError("an empty endpoint: leave it null for no tracing")
        return endpoint


def parse_api_keys(value: str) -> dict[str, str]:
    """`"key1:tenantA,key2:tenantB"` -> {"key1": "tenantA", "key2": "tenantB"}."""
    keys: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"expected key:tenant, got {item!r}")
        keys[key] = tenant
    return keys


def _api_keys(value: Any) -> Any:
    return parse_api_keys(value) if isinstance(value, str) else value


class SluiceConfig(_Section):
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description="tenants by name; with no API key anywhere, one open tenant 'default'",
    )
    api_keys: Annotated[dict[str, str], BeforeValidator(_api_keys)] = Field(
        default_factory=dict,
        description=f"API key -> tenant, besides the tenants' own ({API_KEYS_ENV}="
        "key1:tenantA,key2:tenantB); a tenant named only here has no limits",
    )
    classes: dict[TrafficClass, ClassConfig] = Field(default_factory=_default_classes)
    budgets: BudgetConfig = BudgetConfig()
    estimates: EstimateConfig = EstimateConfig()
    slo: SloConfig = SloConfig()
    resume: ResumeConfig = ResumeConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    responses: ResponsesConfig = ResponsesConfig()
    conversations: ConversationsConfig = ConversationsConfig()
    state: StateConfig = StateConfig()
    tracing: TracingConfig = TracingConfig()

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_default(cls, value: Any) -> Any:
        """An empty section in YAML (`budgets:`) reads as None: the defaults."""
        if value is None:
            return {}
        return value

    @field_validator("tenants", mode="before")
    @classmethod
    def _named(cls, raw: Any) -> Any:
        """A tenant's name is its key; a `name:` inside that says otherwise is an error, not
        silently overwritten."""
        if not isinstance(raw, Mapping):
            return raw
        named = {}
        for key, values in raw.items():
            name = str(key)
            if _is_mapping(values):
                given = (values or {}).get("name", name)
                if given != name:
                    raise ValueError(
                        f"tenant {name!r} has name {given!r}: a tenant's name is its key "
                        "under tenants (leave name out)"
                    )
                values = {**(values or {}), "name": name}
            named[name] = values
        return named

    @field_validator("classes", mode="before")
    @classmethod
    def _class_defaults(cls, raw: Any) -> Any:
        """A class's settings over its own defaults (a chat's deadline is not a batch's)."""
        if not isinstance(raw, Mapping):
            return raw
        merged: dict[Any, Any] = dict(_default_classes())
        for key, values in raw.items():
            base = _CLASS_DEFAULTS.get(key)  # a StrEnum hashes as its value
            merged[key] = {**base, **values} if base and _is_mapping(values) else values
        return merged

    @model_validator(mode="before")
    @classmethod
    def _tenants_of_keys(cls, data: Any) -> Any:
        """Add the tenants named only by `api_keys` (they have no limits), and with no API key
        anywhere, the open tenant every request belongs to."""
        if not isinstance(data, Mapping) or not _is_mapping(data.get("tenants")):
            return data
        tenants = dict(data.get("tenants") or {})
        try:
            extra = _api_keys(data.get("api_keys") or {})
        except ValueError:
            return data  # the field's validator says what is wrong
        if isinstance(extra, Mapping):
            for name in extra.values():
                tenants.setdefault(str(name), {})
        if not extra and not any(map(_has_keys, tenants.values())):
            tenants.setdefault(OPEN_TENANT, {})
        return {**data, "tenants": tenants}

    @model_validator(mode="after")
    def _one_tenant_per_key(self) -> SluiceConfig:
        _key_tables(self.tenants, self.api_keys)
        return self

    @cached_property
    def key_tenants(self) -> dict[str, str]:
        """Every plain API key -> its tenant."""
        return _key_tables(self.tenants, self.api_keys)[0]

    @cached_property
    def digest_tenants(self) -> dict[str, str]:
        """Every key kept as a SHA-256 digest (hex) -> its tenant."""
        return _key_tables(self.tenants, self.api_keys)[1]

    @property
    def is_open(self) -> bool:
        """No API keys configured: every request is the default tenant's."""
        return not (self.key_tenants or self.digest_tenants)


def _is_mapping(value: Any) -> bool:
    return value is None or isinstance(value, Mapping)


def _has_keys(tenant: Any) -> bool:
    if isinstance(tenant, TenantConfig):
        return bool(tenant.api_keys or tenant.api_key_sha256)
    return isinstance(tenant, Mapping) and bool(
        tenant.get("api_keys") or tenant.get("api_key_sha256")
    )


def _key_tables(
    tenants: Mapping[str, TenantConfig], extra: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(plain key -> tenant, digest -> tenant); a ValueError naming the path when a key is
    given to two tenants (either would be picked by chance)."""
    keys: dict[str, str] = {}
    digests: dict[str, str] = {}

    def claim(table: dict[str, str], key: str, tenant: str, where: str) -> None:
        if table.get(key, tenant) != tenant:
            raise ValueError(f"{where}: a key is configured for both {table[key]} and {tenant}")
        table[key] = tenant

    for name, tenant in tenants.items():
        for key in tenant.api_keys:
            claim(keys, key, name, f"tenants.{name}.api_keys")
        for digest in tenant.api_key_sha256:
            claim(digests, digest, name, f"tenants.{name}.api_key_sha256")
    for key, name in extra.items():
        claim(keys, key, name, "api_keys")
    return keys, digests


def key_digest(key: str) -> str:
    """What `api_key_sha256` holds for a key: its SHA-256, in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_config(raw: Mapping[str, Any], env_api_keys: str | None = None) -> SluiceConfig:
    """A SluiceConfig from parsed YAML (and the SLUICE_API_KEYS value, if any).

    Strict: an unknown key, a wrong type or an out-of-range value is a ConfigError naming its
    path (`tenants.acme.max_concurent: unknown key; did you mean max_concurrent?`)."""
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {raw!r}")
    data = dict(raw or {})
    if env_api_keys:
        data["api_keys"] = env_api_keys
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc.errors()[0], SluiceConfig)) from None
