"""Sluice's configuration: tenants and their API keys, per-class limits, scheduler budgets.

Loaded from a YAML file (`sluice serve --config PATH`) plus the environment variable
`SLUICE_API_KEYS="key1:tenantA,key2:tenantB"`. With no API keys anywhere, Sluice runs open:
every request belongs to the single tenant `default`. See the README's "Configuration".
"""

from __future__ import annotations

import os
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
    classes: dict[TrafficClass, ClassConfig] = field(default_factory=_default_classes)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    estimates: EstimateConfig = field(default_factory=EstimateConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)

    @property
    def is_open(self) -> bool:
        """No API keys configured: every request is the default tenant's."""
        return not self.api_keys


def _traffic_class(value: Any, where: str) -> TrafficClass:
    try:
        return TrafficClass(str(value))
    except ValueError:
        raise ConfigError(f"{where}: unknown traffic class {value!r}") from None


def _positive(value: Any, where: str, kind: type = float) -> Any:
    if value is None:
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return number


def _share(value: Any, where: str) -> float:
    share = float(value)
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"{where}: a share must be in [0, 1), got {value!r}")
    return share


def _parse_tenant(name: str, raw: Mapping[str, Any]) -> TenantConfig:
    where = f"tenants.{name}"
    allowed = frozenset(
        _traffic_class(c, f"{where}.allowed_classes")
        for c in raw.get("allowed_classes", [c.value for c in TrafficClass])
    )
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
    for key, values in raw.items():
        traffic_class = _traffic_class(key, "classes")
        where = f"classes.{key}"
        base = classes[traffic_class]
        values = values or {}
        classes[traffic_class] = ClassConfig(
            deadline_s=_positive(values["deadline_ms"], f"{where}.deadline_ms") / 1000.0
            if "deadline_ms" in values
            else base.deadline_s,
            max_queued=_positive(values.get("max_queued", base.max_queued), where, int),
            max_queued_tokens=_positive(
                values.get("max_queued_tokens", base.max_queued_tokens), where, int
            ),
            tenant_queue_share=float(values.get("tenant_queue_share", base.tenant_queue_share)),
        )
    return classes


def _parse_budgets(raw: Mapping[str, Any]) -> BudgetConfig:
    base = BudgetConfig()
    kv = float(raw.get("kv_target_utilization", base.kv_target_utilization))
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
            f"budgets.preempt_bulk_after_ms: must be a number >= 0 or null, got {value!r}")
    return float(value) / 1000.0


def _parse_estimates(raw: Mapping[str, Any]) -> EstimateConfig:
    base = EstimateConfig()
    return EstimateConfig(
        prefill_tokens_per_s=_positive(
            raw.get("prefill_tokens_per_s", base.prefill_tokens_per_s), "estimates.prefill"
        ),
        decode_tokens_per_s=_positive(
            raw.get("decode_tokens_per_s", base.decode_tokens_per_s), "estimates.decode"
        ),
        smoothing=_share(raw.get("smoothing", base.smoothing), "estimates.smoothing"),
        open_ended_output_tokens=_positive(
            raw.get("open_ended_output_tokens", base.open_ended_output_tokens),
            "estimates.open_ended_output_tokens",
        ),
        admission_margin=_share(
            raw.get("admission_margin", base.admission_margin), "estimates.admission_margin"),
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
    interactive = raw.get("interactive") or {}
    if not isinstance(interactive, Mapping):
        raise ConfigError("slo.interactive: expected a mapping")
    knee_share = float(raw.get("knee_share", base.knee_share))
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


def _parse_resume(resume: Mapping[str, Any], idempotency: Mapping[str, Any]) -> ResumeConfig:
    base = ResumeConfig()
    for where, section in (("resume", resume), ("idempotency", idempotency)):
        if not isinstance(section, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
    return ResumeConfig(
        grace_s=_positive(resume.get("grace_seconds", base.grace_s), "resume.grace_seconds"),
        retention_s=_positive(idempotency.get("retention_seconds", base.retention_s),
                              "idempotency.retention_seconds"),
        max_bytes=_positive(idempotency.get("max_bytes", base.max_bytes),
                            "idempotency.max_bytes", int),
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


def parse_config(raw: Mapping[str, Any], env_api_keys: str | None = None) -> SluiceConfig:
    """Build a SluiceConfig from parsed YAML and the SLUICE_API_KEYS value (if any)."""
    tenants_raw: Mapping[str, Any] = raw.get("tenants") or {}
    tenants = {name: _parse_tenant(name, values or {}) for name, values in tenants_raw.items()}
    api_keys: dict[str, str] = {}
    for name, values in tenants_raw.items():
        for key in (values or {}).get("api_keys", []):
            api_keys[str(key)] = name
    if env_api_keys:
        api_keys.update(parse_api_keys_env(env_api_keys))
    for tenant in set(api_keys.values()) - tenants.keys():
        tenants[tenant] = TenantConfig(tenant)  # a key for an unconfigured tenant: no limits
    if not api_keys:
        tenants.setdefault(OPEN_TENANT, TenantConfig(OPEN_TENANT))
    return SluiceConfig(
        tenants=tenants,
        api_keys=api_keys,
        classes=_parse_classes(raw.get("classes") or {}),
        budgets=_parse_budgets(raw.get("budgets") or {}),
        estimates=_parse_estimates(raw.get("estimates") or {}),
        slo=_parse_slo(raw.get("slo") or {}),
        resume=_parse_resume(raw.get("resume") or {}, raw.get("idempotency") or {}),
    )


def load_config(path: Path | None) -> SluiceConfig:
    """The configuration from `path` (YAML) and the environment; defaults when `path` is None."""
    raw: Mapping[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw = loaded or {}
    return parse_config(raw, os.environ.get(API_KEYS_ENV))


def with_budgets(config: SluiceConfig, **changes: Any) -> SluiceConfig:
    """A copy of `config` with some budget settings changed (for tests and the simulator)."""
    return replace(config, budgets=replace(config.budgets, **changes))
