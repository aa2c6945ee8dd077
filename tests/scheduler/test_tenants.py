"""Identity and admission: API key -> tenant -> ticket (class, deadline)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from server.core.config import ConfigError, key_digest, parse_config
from server.core.errors import InvalidRequest, TooManyFailedAttempts, Unauthorized
from server.core.settings import load_config
from server.http.edge import context_from_headers
from server.scheduler.types import TrafficClass
from server.tenancy.tenants import TenantDirectory

CHAT, BULK = TrafficClass.INTERACTIVE, TrafficClass.BULK

YAML = """
tenants:
  acme:
    api_keys: [sk-acme]
    max_concurrent: 8
    tokens_per_minute: 100000
  batchco:
    api_keys: [sk-batch]
    allowed_classes: [bulk]
classes:
  interactive: {deadline_ms: 20000, max_queued: 64}
  bulk: {deadline_ms: 300000}
budgets:
  kv_target_utilization: 0.8
  interactive_reserve_share: 0.25
"""


def directory(raw: dict | None = None, env: str | None = None) -> TenantDirectory:
    return TenantDirectory(parse_config(raw or {}, env))


def make(d: TenantDirectory, key: str | None = None, **headers: str | None):
    """A ticket for a request with these headers (and `service_tier`), read as the edge does."""
    context = context_from_headers(
        {
            "x-traffic-class": headers.get("traffic_class_header"),
            "x-request-timeout-ms": headers.get("timeout_ms_header"),
        }
    )
    values = {
        "service_tier": headers.get("service_tier"),
        "asked_class": context.traffic_class,
        "timeout_s": context.timeout_s,
    }
    return d.make_ticket(
        tenant=d.authenticate(key),
        request_id="req-1",
        model="m",
        prompt_tokens=5,
        max_tokens=7,
        arrival=100.0,
        **values,
    )


def test_open_mode_has_one_default_tenant_and_accepts_any_key() -> None:
    d = directory()
    assert d.is_open
    assert d.authenticate(None).name == "default"
    assert d.authenticate("whatever").name == "default"


def test_keys_from_file_and_environment_map_to_tenants(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text(YAML)
    monkeypatch.setenv("SLUICE_API_KEYS", "sk-env:envco,sk-acme2:acme")
    d = TenantDirectory(load_config(path))
    assert d.authenticate("sk-acme").name == "acme"
    assert d.authenticate("sk-acme2").name == "acme"
    assert d.authenticate("sk-env").name == "envco"
    assert d.tenant("acme").config.max_concurrent == 8
    with pytest.raises(Unauthorized) as missing:
        d.authenticate(None)
    assert missing.value.status == 401
    with pytest.raises(Unauthorized):
        d.authenticate("sk-wrong")


def test_loaded_config_values() -> None:
    cfg = parse_config(yaml.safe_load(YAML))
    assert cfg.classes[CHAT].deadline_s == 20.0
    assert cfg.classes[CHAT].max_queued == 64
    assert cfg.classes[BULK].deadline_s == 300.0
    assert cfg.budgets.kv_target_utilization == 0.8
    assert cfg.tenants["batchco"].default_class is BULK
    assert load_config(None).is_open


def test_bad_config_is_reported() -> None:
    with pytest.raises(ConfigError):
        parse_config({"budgets": {"interactive_reserve_share": 1.5}})
    with pytest.raises(ConfigError):
        parse_config({"tenants": {"t": {"allowed_classes": ["gold"]}}})
    with pytest.raises(ConfigError):
        parse_config({}, "no-colon")


@pytest.mark.parametrize(
    ("tier", "header", "expected"),
    [
        (None, None, CHAT),
        ("flex", None, BULK),
        ("auto", None, CHAT),
        ("default", None, CHAT),
        ("priority", None, CHAT),
        ("flex", "interactive", CHAT),  # the header wins
        ("priority", "bulk", BULK),
    ],
)
def test_traffic_class_from_service_tier_or_header(tier, header, expected) -> None:
    t = make(directory(), service_tier=tier, traffic_class_header=header)
    assert t.traffic_class is expected


def test_class_is_capped_by_what_the_tenant_may_use() -> None:
    d = directory(yaml.safe_load(YAML))
    t = make(d, "sk-batch", traffic_class_header="interactive")
    assert t.traffic_class is BULK  # downgraded to the tenant's default, not refused
    make(d, "sk-batch", traffic_class_header="bulk")
    make(d, "sk-acme", traffic_class_header="interactive")
    assert d.downgrades == {("batchco", CHAT): 1}  # counted, for the metric


def test_bad_class_values_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequest):
        make(directory(), traffic_class_header="urgent")
    with pytest.raises(InvalidRequest):
        make(directory(), service_tier="gold")


def test_deadline_from_header_else_class_default() -> None:
    d = directory(yaml.safe_load(YAML))
    t = make(d, "sk-acme", timeout_ms_header="1500")
    assert (t.arrival, t.deadline) == (100.0, 101.5)
    assert make(d, "sk-acme").deadline == 120.0
    assert make(d, "sk-acme", service_tier="flex").deadline == 400.0
    for bad in ("0", "-5", "soon"):
        with pytest.raises(InvalidRequest):
            make(d, "sk-acme", timeout_ms_header=bad)


def test_ticket_carries_identity() -> None:
    t = make(directory())
    assert (t.request_id, t.tenant, t.model, t.reserved_tokens) == ("req-1", "default", "m", 12)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"tenants": {"acme": {"api_keys": ["k1"], "max_concurent": 1}}},
            "tenants.acme.max_concurent: unknown key; did you mean max_concurrent?",
        ),
        ({"budget": {"max_running_seqs": 8}}, "budget: unknown key; did you mean budgets?"),
        (
            {"budgets": {"max_running_seqs": "many"}},
            "budgets.max_running_seqs: expected a whole number, got 'many'",
        ),
        (
            {"classes": {"interactive": {"max_queued": 2.5}}},
            "classes.interactive.max_queued: expected a whole number, got 2.5",
        ),
        (
            {"slo": {"interactive": {"ttft": 200}}},
            "slo.interactive.ttft: unknown key; did you mean ttft_ms?",
        ),
        (
            {"budgets": {"kv_target_utilization": True}},
            "budgets.kv_target_utilization: expected a number, got True",
        ),
        (
            {"tenants": {"acme": {"api_key_sha256": ["abc"]}}},
            "tenants.acme.api_key_sha256: abc… is not a SHA-256 digest (64 hex digits)",
        ),
        (
            {"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}},
            "tenants.b.api_keys: a key is configured for both a and b",
        ),
        (
            {"state": {"url": "http://redis:6379"}},
            "state.url: expected a redis://, rediss:// or unix:// URL, got 'http://redis:6379'",
        ),
        (
            {"state": {"lease_secs": 5}},
            "state.lease_secs: unknown key; did you mean lease_seconds?",
        ),
    ],
)
def test_the_configuration_is_strict_and_names_the_path(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(raw)
    assert str(raised.value) == message


def test_keys_may_be_kept_as_digests_only() -> None:
    d = directory({"tenants": {"acme": {"api_key_sha256": [key_digest("sk-secret")]}}})
    assert not d.is_open
    assert d.authenticate("sk-secret").name == "acme"
    with pytest.raises(Unauthorized):
        d.authenticate("sk-secret2")


def test_failed_attempts_throttle_an_address_whatever_key_it_sends() -> None:
    clock = [0.0]
    d = TenantDirectory(parse_config({}, "sk-good:acme"), clock=lambda: clock[0])
    for _ in range(10):
        with pytest.raises(Unauthorized):
            d.authenticate("sk-bad", "10.0.0.1")
    with pytest.raises(TooManyFailedAttempts) as raised:
        d.authenticate("sk-good", "10.0.0.1")
    assert raised.value.retry_after == 60.0
    assert d.authenticate("sk-good", "10.0.0.2").name == "acme"  # another address
    clock[0] = 61.0
    assert d.authenticate("sk-good", "10.0.0.1").name == "acme"  # the window passed
