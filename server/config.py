"""Sluice's configuration: tenants and their API keys, per-class limits, scheduler budgets.

Loaded from a YAML file (`sluice serve --config PATH`) plus the environment variable
`SLUICE_API_KEYS="key1:tenantA,key2:tenantB"`. With no API keys anywhere, Sluice runs open:
every request belongs to the single tenant `default`. See the README's "Configuration".
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from server.scheduler.types import TrafficClass

OPEN_TENANT = "default"
API_KEYS_ENV = "SLUICE_API_KEYS"


class ConfigError(ValueError):
    """The configuration file or environment is malformed."""


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    max_concurrent: int | None = None  # queued + running requests at once
    tokens_per_minute: int | None = None  # prompt + max_tokens admitted per rolling minute
    allowed_classes: frozenset[TrafficClass] = frozenset(TrafficClass)
    default_class: TrafficClass = TrafficClass.INTERACTIVE


@dataclass(frozen=True, slots=True)
class ClassConfig:
    deadline_s: float  # deadline when the request carries no X-Request-Timeout-Ms
    max_queued: int  # requests waiting, per model
    max_queued_tokens: int  # prompt + max_tokens of requests waiting, per model
    tenant_queue_share: float = 0.5  # most of max_queued one tenant may hold (with >1 tenant)


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    kv_target_utilization: float = 0.9  # share of the engine's KV blocks Sluice may reserve
    interactive_reserve_share: float = 0.2  # share of each budget bulk may never take
    bulk_min_share: float = 0.1  # share of each budget bulk is guaranteed while waiting
    max_running_seqs: int = 256
    max_running_tokens: int | None = None  # None: the KV-cache budget in tokens
    fairness_quantum_tokens: int = 1024  # credit per DRR turn; smaller = finer interleaving
    # A chat queued this long (no room even in its reserve) stops running bulk work, which is
    # requeued as a continuation; None: never preempt.
    preempt_bulk_after_s: float | None = 0.5


@dataclass(frozen=True, slots=True)
class EstimateConfig:
    """Priors for the online rate estimates, used until the engine has been observed."""

    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 100.0  # per running sequence
    # Tokens an answer without max_tokens is expected to produce (it reserves the whole
    # context in the budgets, but admission judges its completion time by this length).
    open_ended_output_tokens: float = 256.0
    # Admission keeps this share of a request's predicted time to completion as a margin for
    # the estimate's error: at the edge of a full queue, an unbiased estimate alone would
    # admit requests of which about half then miss their deadline.
    admission_margin: float = 0.1
    smoothing: float = 0.2  # weight of each new observation in the moving average
    # Measure the engine at start-up (step time at several concurrencies, idle time to first
    # token) instead of starting from the priors above.
    calibrate: bool = True


@dataclass(frozen=True, slots=True)
class SloConfig:
    """The interactive class's targets, and how bulk makes room for them.

    Targets default to a multiple of what the engine shows when nearly idle (its time to first
    token, its step time over one sequence), so they suit any hardware; a setting in
    milliseconds overrides them.
    """

    ttft_s: float | None = None  # None: ttft_factor x the idle time to first token
    itl_s: float | None = None  # None: itl_factor x the idle gap between tokens (one step)
    ttft_factor: float = 3.0
    itl_factor: float = 3.0
    # Cap running bulk so that, while chats run, the predicted step time stays within the gap
    # target; false: bulk runs up to its budgets, as before.
    cap_bulk: bool = True
    # Bulk stays capped this long after the last chat ends, so a steady trickle of chats does
    # not make bulk pay for a preemption each.
    bulk_hold_s: float = 1.0
    # With no chat about, bulk runs at the fewest sequences that reach this share of the best
    # tokens/s seen (the knee), not beyond.
    knee_share: float = 0.95


@dataclass(frozen=True, slots=True)
class ResumeConfig:
    """Generations that outlive their connection (sent with an idempotency key)."""

    grace_s: float = 30.0  # a running generation's life without a reader
    retention_s: float = 86400.0  # how long an ended one can be replayed
    max_bytes: int = 256 << 20  # all their event logs together; the oldest ended go first


@dataclass(frozen=True, slots=True)
class StateConfig:
    """Where state shared by replicas lives. `url` None: in this process only, as with one
    replica. With a Redis URL, tenant quotas hold across every replica using it, and
    resumable generations can be retried, resumed and taken over on any of them."""

    url: str | None = None
    # A replica renews what it holds (a quota slot per running request, a lease per resumable
    # generation it runs) every third of this; a replica that dies stops renewing, and its
    # holdings expire this long after.
    lease_s: float = 10.0
    timeout_s: float = 0.25  # a call slower than this counts as Redis being unavailable
    # With Redis unavailable, each replica enforces 1/replicas of every tenant's limits: the
    # replicas Redis last counted, or this until it has counted any.
    replicas: int = 1


def _default_classes() -> dict[TrafficClass, ClassConfig]:
    return {
        TrafficClass.INTERACTIVE: ClassConfig(
            deadline_s=30.0, max_queued=256, max_queued_tokens=256 * 2048
        ),
        TrafficClass.BULK: ClassConfig(
            deadline_s=600.0, max_queued=1024, max_queued_tokens=1024 * 4096
        ),
    }


@dataclass(frozen=True, slots=True)
class SluiceConfig:
    tenants: dict[str, TenantConfig] = field(
        default_factory=lambda: {OPEN_TENANT: TenantConfig(OPEN_TENANT)}
    )
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant name
    # SHA-256 digests (hex) of keys kept only as digests -> tenant name.
    api_key_digests: dict[str, str] = field(default_factory=dict)
    classes: dict[TrafficClass, ClassConfig] = field(default_factory=_default_classes)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    estimates: EstimateConfig = field(default_factory=EstimateConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    state: StateConfig = field(default_factory=StateConfig)

    @property
    def is_open(self) -> bool:
        """No API keys configured: every request is the default tenant's."""
        return not (self.api_keys or self.api_key_digests)


def key_digest(key: str) -> str:
    """What `api_key_sha256` holds for a key: its SHA-256, in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def _section(raw: Any, where: str, allowed: tuple[str, ...] | frozenset[str]) -> Mapping[str, Any]:
    """`raw` as a mapping with only `allowed` keys (None: empty); else a ConfigError naming
    the path, and the key meant when one is close."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    for key in raw:
        if key not in allowed:
            path = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = (
                f"; did you mean {close[0]}?"
                if close
                else (f"; expected one of: {', '.join(sorted(allowed))}")
            )
            raise ConfigError(f"{path}: unknown key{hint}")
    return raw


def _traffic_class(value: Any, where: str) -> TrafficClass:
    try:
        return TrafficClass(str(value))
    except ValueError:
        raise ConfigError(f"{where}: unknown traffic class {value!r}") from None


def _positive(value: Any, where: str, kind: type = float) -> Any:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        expected = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return number


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _share(value: Any, where: str) -> float:
    share = _number(value, where)
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"{where}: a share must be in [0, 1), got {value!r}")
    return share


_TENANT_KEYS = (
    "api_keys",
    "api_key_sha256",
    "max_concurrent",
    "tokens_per_minute",
    "allowed_classes",
    "default_class",
)
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _keys(raw: Mapping[str, Any], where: str) -> tuple[list[str], list[str]]:
    """A tenant's plain keys and key digests, checked."""
    plain, digests = raw.get("api_keys") or [], raw.get("api_key_sha256") or []
    for name, values in (("api_keys", plain), ("api_key_sha256", digests)):
        if not isinstance(values, list) or not all(
            isinstance(v, str) and v.strip() for v in values
        ):
            raise ConfigError(f"{where}.{name}: expected a list of non-empty strings")
    for digest in digests:
        if not _DIGEST.fullmatch(digest.lower()):
            raise ConfigError(
                f"{where}.api_key_sha256: {digest[:12]}… is not a SHA-256 digest (64 hex digits)"
            )
    return plain, [d.lower() for d in digests]


def _parse_tenant(name: str, raw: Mapping[str, Any]) -> TenantConfig:
    where = f"tenants.{name}"
    raw = _section(raw, where, _TENANT_KEYS)
    allowed_raw = raw.get("allowed_classes", [c.value for c in TrafficClass])
    if not isinstance(allowed_raw, list):
        raise ConfigError(f"{where}.allowed_classes: expected a list, got {allowed_raw!r}")
    allowed = frozenset(_traffic_class(c, f"{where}.allowed_classes") for c in allowed_raw)
    if not allowed:
        raise ConfigError(f"{where}.allowed_classes: must not be empty")
    default_raw = raw.get("default_class")
    if default_raw is None:
        default = (
            TrafficClass.INTERACTIVE if TrafficClass.INTERACTIVE in allowed else TrafficClass.BULK
        )
    else:
        default = _traffic_class(default_raw, f"{where}.default_class")
    if default not in allowed:
        raise ConfigError(f"{where}.default_class: {default} is not in allowed_classes")
    return TenantConfig(
        name=name,
        max_concurrent=_positive(raw.get("max_concurrent"), f"{where}.max_concurrent", int),
        tokens_per_minute=_positive(
            raw.get("tokens_per_minute"), f"{where}.tokens_per_minute", int
        ),
        allowed_classes=allowed,
        default_class=default,
    )


def _parse_classes(raw: Mapping[str, Any]) -> dict[TrafficClass, ClassConfig]:
    classes = _default_classes()
    raw = _section(raw, "classes", tuple(c.value for c in TrafficClass))
    for key, values in raw.items():
        traffic_class = _traffic_class(key, "classes")
        where = f"classes.{key}"
        base = classes[traffic_class]
        values = _section(
            values, where, ("deadline_ms", "max_queued", "max_queued_tokens", "tenant_queue_share")
        )
        classes[traffic_class] = ClassConfig(
            deadline_s=_positive(values["deadline_ms"], f"{where}.deadline_ms") / 1000.0
            if "deadline_ms" in values
            else base.deadline_s,
            max_queued=_positive(
                values.get("max_queued", base.max_queued), f"{where}.max_queued", int
            ),
            max_queued_tokens=_positive(
                values.get("max_queued_tokens", base.max_queued_tokens),
                f"{where}.max_queued_tokens",
                int,
            ),
            tenant_queue_share=_number(
                values.get("tenant_queue_share", base.tenant_queue_share),
                f"{where}.tenant_queue_share",
            ),
        )
    return classes


def _parse_budgets(raw: Mapping[str, Any]) -> BudgetConfig:
    base = BudgetConfig()
    raw = _section(
        raw,
        "budgets",
        (
            "kv_target_utilization",
            "interactive_reserve_share",
            "bulk_min_share",
            "max_running_seqs",
            "max_running_tokens",
            "fairness_quantum_tokens",
            "preempt_bulk_after_ms",
        ),
    )
    kv = _number(
        raw.get("kv_target_utilization", base.kv_target_utilization),
        "budgets.kv_target_utilization",
    )
    if not 0.0 < kv <= 1.0:
        raise ConfigError(f"budgets.kv_target_utilization: must be in (0, 1], got {kv}")
    reserve = _share(
        raw.get("interactive_reserve_share", base.interactive_reserve_share),
        "budgets.interactive_reserve_share",
    )
    bulk_min = _share(raw.get("bulk_min_share", base.bulk_min_share), "budgets.bulk_min_share")
    if bulk_min > 1.0 - reserve:
        raise ConfigError("budgets.bulk_min_share: exceeds what the interactive reserve leaves")
    return BudgetConfig(
        kv_target_utilization=kv,
        interactive_reserve_share=reserve,
        bulk_min_share=bulk_min,
        max_running_seqs=_positive(
            raw.get("max_running_seqs", base.max_running_seqs), "budgets.max_running_seqs", int
        ),
        max_running_tokens=_positive(
            raw.get("max_running_tokens"), "budgets.max_running_tokens", int
        ),
        fairness_quantum_tokens=_positive(
            raw.get("fairness_quantum_tokens", base.fairness_quantum_tokens),
            "budgets.fairness_quantum_tokens",
            int,
        ),
        preempt_bulk_after_s=_preempt_after(raw, base.preempt_bulk_after_s),
    )


def _preempt_after(raw: Mapping[str, Any], default: float | None) -> float | None:
    if "preempt_bulk_after_ms" not in raw:
        return default
    value = raw["preempt_bulk_after_ms"]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(
            f"budgets.preempt_bulk_after_ms: must be a number >= 0 or null, got {value!r}"
        )
    return float(value) / 1000.0


def _parse_estimates(raw: Mapping[str, Any]) -> EstimateConfig:
    base = EstimateConfig()
    raw = _section(
        raw,
        "estimates",
        (
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "smoothing",
            "open_ended_output_tokens",
            "admission_margin",
            "calibrate",
        ),
    )
    return EstimateConfig(
        prefill_tokens_per_s=_positive(
            raw.get("prefill_tokens_per_s", base.prefill_tokens_per_s),
            "estimates.prefill_tokens_per_s",
        ),
        decode_tokens_per_s=_positive(
            raw.get("decode_tokens_per_s", base.decode_tokens_per_s),
            "estimates.decode_tokens_per_s",
        ),
        smoothing=_share(raw.get("smoothing", base.smoothing), "estimates.smoothing"),
        open_ended_output_tokens=_positive(
            raw.get("open_ended_output_tokens", base.open_ended_output_tokens),
            "estimates.open_ended_output_tokens",
        ),
        admission_margin=_share(
            raw.get("admission_margin", base.admission_margin), "estimates.admission_margin"
        ),
        calibrate=_flag(raw.get("calibrate", base.calibrate), "estimates.calibrate"),
    )


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _milliseconds(value: Any, where: str) -> float | None:
    number = _positive(value, where)
    return None if number is None else number / 1000.0


def _parse_slo(raw: Mapping[str, Any]) -> SloConfig:
    base = SloConfig()
    raw = _section(
        raw,
        "slo",
        ("interactive", "ttft_factor", "itl_factor", "cap_bulk", "bulk_hold_ms", "knee_share"),
    )
    interactive = _section(raw.get("interactive"), "slo.interactive", ("ttft_ms", "itl_ms"))
    knee_share = _number(raw.get("knee_share", base.knee_share), "slo.knee_share")
    if not 0.0 < knee_share <= 1.0:
        raise ConfigError(f"slo.knee_share: must be in (0, 1], got {knee_share}")
    hold = raw.get("bulk_hold_ms", base.bulk_hold_s * 1000.0)
    if isinstance(hold, bool) or not isinstance(hold, int | float) or hold < 0:
        raise ConfigError(f"slo.bulk_hold_ms: must be a number >= 0, got {hold!r}")
    return SloConfig(
        ttft_s=_milliseconds(interactive.get("ttft_ms"), "slo.interactive.ttft_ms"),
        itl_s=_milliseconds(interactive.get("itl_ms"), "slo.interactive.itl_ms"),
        ttft_factor=_positive(raw.get("ttft_factor", base.ttft_factor), "slo.ttft_factor"),
        itl_factor=_positive(raw.get("itl_factor", base.itl_factor), "slo.itl_factor"),
        cap_bulk=_flag(raw.get("cap_bulk", base.cap_bulk), "slo.cap_bulk"),
        bulk_hold_s=float(hold) / 1000.0,
        knee_share=knee_share,
    )


def _parse_resume(resume: Any, idempotency: Any) -> ResumeConfig:
    base = ResumeConfig()
    resume = _section(resume, "resume", ("grace_seconds",))
    idempotency = _section(idempotency, "idempotency", ("retention_seconds", "max_bytes"))
    return ResumeConfig(
        grace_s=_positive(resume.get("grace_seconds", base.grace_s), "resume.grace_seconds"),
        retention_s=_positive(
            idempotency.get("retention_seconds", base.retention_s), "idempotency.retention_seconds"
        ),
        max_bytes=_positive(
            idempotency.get("max_bytes", base.max_bytes), "idempotency.max_bytes", int
        ),
    )


def _parse_state(raw: Any) -> StateConfig:
    base = StateConfig()
    raw = _section(raw, "state", ("url", "lease_seconds", "timeout_ms", "replicas"))
    url = raw.get("url")
    if url is not None and not (
        isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))
    ):
        raise ConfigError(f"state.url: expected a redis://, rediss:// or unix:// URL, got {url!r}")
    timeout_ms = _positive(raw.get("timeout_ms", base.timeout_s * 1000), "state.timeout_ms")
    return StateConfig(
        url=url,
        lease_s=_positive(raw.get("lease_seconds", base.lease_s), "state.lease_seconds"),
        timeout_s=timeout_ms / 1000.0,
        replicas=_positive(raw.get("replicas", base.replicas), "state.replicas", int),
    )


def parse_api_keys_env(value: str) -> dict[str, str]:
    """`"key1:tenantA,key2:tenantB"` -> {"key1": "tenantA", "key2": "tenantB"}."""
    keys: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant:
            raise ConfigError(f"{API_KEYS_ENV}: expected key:tenant, got {item!r}")
        keys[key] = tenant
    return keys


_TOP_LEVEL = ("tenants", "classes", "budgets", "estimates", "slo", "resume", "idempotency", "state")


def parse_config(raw: Mapping[str, Any], env_api_keys: str | None = None) -> SluiceConfig:
    """Build a SluiceConfig from parsed YAML and the SLUICE_API_KEYS value (if any).

    Strict: an unknown key, a wrong type or an out-of-range value is a ConfigError naming its
    path (`tenants.acme.max_concurent: unknown key; did you mean max_concurrent?`)."""
    raw = _section(raw, "", _TOP_LEVEL)
    tenants_raw = raw.get("tenants") or {}
    if not isinstance(tenants_raw, Mapping):
        raise ConfigError(f"tenants: expected a mapping of tenant names, got {tenants_raw!r}")
    tenants = {
        str(name): _parse_tenant(str(name), values or {}) for name, values in tenants_raw.items()
    }
    api_keys: dict[str, str] = {}
    digests: dict[str, str] = {}
    for name, values in tenants_raw.items():
        plain, hashed = _keys(values or {}, f"tenants.{name}")
        for key in plain:
            _claim(api_keys, key, str(name), f"tenants.{name}.api_keys")
        for digest in hashed:
            _claim(digests, digest, str(name), f"tenants.{name}.api_key_sha256")
    if env_api_keys:
        for key, tenant in parse_api_keys_env(env_api_keys).items():
            _claim(api_keys, key, tenant, API_KEYS_ENV)
    for tenant in (set(api_keys.values()) | set(digests.values())) - tenants.keys():
        tenants[tenant] = TenantConfig(tenant)  # a key for an unconfigured tenant: no limits
    if not (api_keys or digests):
        tenants.setdefault(OPEN_TENANT, TenantConfig(OPEN_TENANT))
    return SluiceConfig(
        tenants=tenants,
        api_keys=api_keys,
        api_key_digests=digests,
        classes=_parse_classes(raw.get("classes") or {}),
        budgets=_parse_budgets(raw.get("budgets") or {}),
        estimates=_parse_estimates(raw.get("estimates") or {}),
        slo=_parse_slo(raw.get("slo") or {}),
        resume=_parse_resume(raw.get("resume") or {}, raw.get("idempotency") or {}),
        state=_parse_state(raw.get("state") or {}),
    )


def _claim(keys: dict[str, str], key: str, tenant: str, where: str) -> None:
    """One key, one tenant: a key given to two tenants would pick one of them by chance."""
    if keys.get(key, tenant) != tenant:
        raise ConfigError(f"{where}: a key is configured for both {keys[key]} and {tenant}")
    keys[key] = tenant


def load_config(path: Path | None, environ: Mapping[str, str] = os.environ) -> SluiceConfig:
    """The configuration from `path` (YAML) and `environ`; defaults when `path` is None."""
    raw: Mapping[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw = loaded or {}
    try:
        return parse_config(raw, environ.get(API_KEYS_ENV))
    except ConfigError as exc:
        raise ConfigError(f"{path or API_KEYS_ENV}: {exc}") from None


def with_state_url(config: SluiceConfig, url: str) -> SluiceConfig:
    """`config` with `state.url` set (`--state-url`), checked as the file's would be."""
    return replace(config, state=replace(config.state, url=_parse_state({"url": url}).url))
