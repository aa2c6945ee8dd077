"""The configuration declared once: its layers, its bounds, its units, its messages, and the
serve flags derived from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine_adapters.sim import SimConfig
from server.cli import parse_serve
from server.core.config import ConfigError, TrafficClass, parse_config
from server.core.settings import ServeOptions, config_flags, load_config

BULK = TrafficClass.BULK


def serve_args(*flags: str) -> ServeOptions:
    return parse_serve(flags).options


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sluice.yaml"
    path.write_text(text)
    return path


def test_flags_over_environment_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "budgets: {max_running_seqs: 8, fairness_quantum_tokens: 512}\n"
        "state: {url: 'redis://file:6379/0', lease_seconds: 20}\n",
    )
    environ = {
        "SLUICE_BUDGETS__MAX_RUNNING_SEQS": "16",
        "SLUICE_STATE__URL": "redis://env:6379/0",
    }
    flags = config_flags(serve_args("--state-url", "redis://flag:6379/0"))
    config = load_config(path, environ, flags)
    assert config.state.url == "redis://flag:6379/0"  # flag over environment
    assert config.budgets.max_running_seqs == 16  # environment over file
    assert config.budgets.fairness_quantum_tokens == 512  # file over default
    assert config.state.lease_seconds == 20  # the rest of a section is kept, key by key
    assert config.budgets.kv_target_utilization == 0.9  # default

    assert load_config(path, environ).state.url == "redis://env:6379/0"
    assert load_config(path, {}).state.url == "redis://file:6379/0"
    assert load_config(None, {}).state.url is None


def test_environment_keys_add_to_the_files(tmp_path: Path) -> None:
    path = write(tmp_path, "tenants:\n  acme: {api_keys: [sk-file], max_concurrent: 2}\n")
    config = load_config(path, {"SLUICE_API_KEYS": "sk-env:acme,sk-other:beta"})
    assert config.key_tenants == {"sk-file": "acme", "sk-env": "acme", "sk-other": "beta"}
    assert config.tenants["acme"].max_concurrent == 2
    assert config.tenants["beta"].max_concurrent is None  # named only by a key: no limits
    assert "default" not in config.tenants


def test_a_mapping_may_come_from_the_environment_as_json() -> None:
    environ = {"SLUICE_TENANTS": '{"acme": {"api_keys": ["k"], "allowed_classes": ["bulk"]}}'}
    config = load_config(None, environ)
    assert config.tenants["acme"].default_class is BULK
    assert not config.is_open


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"SLUICE_BUDGETS__MAX_RUNNING_SEQS": "many"},
            "environment: budgets.max_running_seqs: expected a whole number, got 'many'",
        ),
        (
            {"SLUICE_BUDGETS__MAX_RUNING_SEQS": "8"},
            "environment: budgets.max_runing_seqs: unknown key; did you mean max_running_seqs?",
        ),
        (
            {"SLUICE_API_KEYS": "no-colon"},
            "environment: api_keys: expected key:tenant, got 'no-colon'",
        ),
    ],
)
def test_an_environment_error_names_its_source_and_path(environ: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, environ)
    assert str(raised.value) == message


def test_a_file_error_names_the_file_and_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "classes:\n  bulk: {tenant_queue_share: 1.5}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, {})
    assert str(raised.value) == (
        f"{path}: classes.bulk.tenant_queue_share: must be less than or equal to 1, got 1.5"
    )


def test_a_flag_error_names_the_layer() -> None:
    flags = config_flags(serve_args("--state-url", "http://redis:6379"))
    with pytest.raises(ConfigError) as raised:
        load_config(None, {}, flags)
    assert str(raised.value) == (
        "flags: state.url: expected a redis://, rediss:// or unix:// URL, got 'http://redis:6379'"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"classes": {"interactive": {"tenant_queue_share": 0}}},
            "classes.interactive.tenant_queue_share: must be greater than 0, got 0",
        ),
        (
            {"budgets": {"kv_target_utilization": 1.01}},
            "budgets.kv_target_utilization: must be less than or equal to 1, got 1.01",
        ),
        (
            {"slo": {"interactive": {"ttft_ms": -5}}},
            "slo.interactive.ttft_ms: must be greater than 0, got -5",
        ),
        (
            {"estimates": {"smoothing": 1}},
            "estimates.smoothing: must be less than 1, got 1",
        ),
        ({"classes": {"gold": {}}}, "classes.gold: must be 'interactive' or 'bulk', got 'gold'"),
        (
            {"idempotency": {"retention_secs": 60}},
            "idempotency.retention_secs: unknown key; did you mean retention_seconds?",
        ),
        (
            {"tenants": {"t": {"allowed_classes": []}}},
            "tenants.t.allowed_classes: must not be empty",
        ),
        ({"budgets": [1, 2]}, "budgets: expected a mapping, got [1, 2]"),
        (
            {"tenants": {"t": {"models": ["a"], "default_model": "b"}}},
            "tenants.t.default_model: b is not in models",
        ),
        ({"tenants": {"t": {"models": []}}}, "tenants.t.models: must not be empty"),
        (
            {"tenants": {"acme": {"name": "other"}}},
            "tenants: tenant 'acme' has name 'other': a tenant's name is its key under tenants "
            "(leave name out)",
        ),
    ],
)
def test_out_of_range_and_unknown_values_are_named_by_path(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(raw)
    assert str(raised.value) == message


def test_units_are_in_the_names_and_read_in_seconds() -> None:
    config = parse_config(
        {
            "classes": {"bulk": {"deadline_ms": 90_000}},
            "budgets": {"preempt_bulk_after_ms": 250},
            "slo": {"interactive": {"ttft_ms": 200, "itl_ms": 40}, "bulk_hold_ms": 1500},
            "state": {"timeout_ms": 100, "lease_seconds": 6},
        }
    )
    assert config.classes[BULK].deadline_s == pytest.approx(90.0)
    assert config.classes[TrafficClass.INTERACTIVE].deadline_s == pytest.approx(30.0)  # default
    assert config.budgets.preempt_bulk_after_s == pytest.approx(0.25)
    assert (config.slo.ttft_s, config.slo.itl_s) == pytest.approx((0.2, 0.04))
    assert config.slo.bulk_hold_s == pytest.approx(1.5)
    assert (config.state.timeout_s, config.state.lease_s) == pytest.approx((0.1, 6.0))
    assert (
        parse_config({"budgets": {"preempt_bulk_after_ms": None}}).budgets.preempt_bulk_after_s
        is None
    )


def test_a_tenant_may_repeat_its_own_name() -> None:
    assert parse_config({"tenants": {"acme": {"name": "acme"}}}).tenants["acme"].name == "acme"


def test_a_class_given_in_part_keeps_its_own_defaults() -> None:
    config = parse_config({"classes": {"bulk": {"max_queued": 8}}})
    assert config.classes[BULK].max_queued == 8
    assert config.classes[BULK].deadline_s == pytest.approx(600.0)  # bulk's, not a chat's


def test_an_empty_section_reads_as_the_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "budgets:\ntenants:\n  acme:\n"), {})
    assert config.budgets.max_running_seqs == 256
    assert config.tenants["acme"].default_class is TrafficClass.INTERACTIVE


def test_serve_flags_keep_their_names_defaults_and_refuse_what_is_out_of_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = serve_args("--engine", "sim", "--engine-arg", "a=1", "--engine-arg", "b=2")
    assert (args.host, args.port, args.engine, args.engine_arg) == (
        "127.0.0.1",
        8000,
        "sim",
        ["a=1", "b=2"],
    )
    assert (args.max_body_bytes, args.enable_auto_tool_choice, args.state_url) == (
        1 << 20,
        False,
        None,
    )
    assert serve_args("--data-dir", "/tmp/x").data_dir == Path("/tmp/x")
    assert serve_args("--drain-seconds", "0.5").drain_seconds == pytest.approx(0.5)
    for flags, message in (
        (("--port", "70000"), "argument --port: must be less than or equal to 65535"),
        (("--sse-ping-seconds", "0"), "argument --sse-ping-seconds: must be greater than 0"),
        (("--max-file-bytes", "1.5"), "argument --max-file-bytes: expected a whole number"),
        (("--log-level", "loud"), "argument --log-level: invalid choice: 'loud'"),
    ):
        with pytest.raises(SystemExit):
            serve_args(*flags)
        assert message in capsys.readouterr().err


def test_a_tenants_default_model_is_the_first_of_its_models() -> None:
    tenants = parse_config({"tenants": {"t": {"models": ["a", "b"]}, "u": {}}}).tenants
    assert (tenants["t"].default_model, tenants["u"].default_model) == ("a", None)


def test_the_command_line_becomes_one_frozen_object_with_the_served_engines_flags() -> None:
    sim = parse_serve(["--engine", "sim", "--sim-step-base-ms", "2.5"])
    assert (sim.sim, sim.batch) == (SimConfig(step_base_ms=2.5), None)
    batch = parse_serve(["--engine", "sim-batch", "--workers", "3", "--batch-ms", "20"])
    assert batch.sim is None and batch.batch is not None
    assert (batch.batch.workers, batch.batch.batch_ms) == (3, 20.0)
    vllm = parse_serve(["--sim-max-num-seqs", "0"])  # the flags of an engine not served: unread
    assert (vllm.options.engine, vllm.sim, vllm.batch) == ("vllm", None, None)
    with pytest.raises(ValidationError, match="frozen"):
        vllm.options.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        vllm.sim = SimConfig()  # type: ignore[misc]
