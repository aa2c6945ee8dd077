"""What `sluice serve` is told, and in what order: its flags, and the configuration's layers.

The configuration (`SluiceConfig`) is read from three sources, each over the one before:

1. the defaults declared on the model (`server.core.config`);
2. the YAML file given by `--config`;
3. the environment: `SLUICE_API_KEYS="key1:tenantA,key2:tenantB"` (keys added to those of
   the file's tenants), and any setting as `SLUICE_<SECTION>__<KEY>`
   (`SLUICE_BUDGETS__MAX_RUNNING_SEQS=64`, `SLUICE_CLASSES__BULK__DEADLINE_MS=900000`; a
   mapping or list as JSON, `null` for None);
4. the flags that set a configuration field (`--state-url` sets `state.url`).

Mappings merge key by key; any other value replaces the one below it. Each layer is checked
as it is added, so an error names its source and its path
(`environment: budgets.max_running_seqs: expected a whole number, got 'many'`).

The serve flags themselves are declared once, as the fields of `ServeOptions`: `add_arguments`
derives each flag (`--max-body-bytes` from `max_body_bytes`), its default, help and bounds.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource

from server.core.config import ConfigError, SluiceConfig, parse_config
from server.core.messages import describe

ENV_PREFIX = "SLUICE_"


def default_cache_dir() -> Path:
    """$SLUICE_CACHE_DIR, else ~/.cache/sluice."""
    return Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/sluice, else ~/.local/share/sluice."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice"


Port = Annotated[int, Field(ge=0, le=65535)]


class ServeOptions(BaseModel):
    """The flags of `sluice serve` (the sim and batch engines add their own), read once from
    the command line and never changed."""

    model_config = ConfigDict(frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: Port = Field(8000, description="port to listen on")
    fd: int | None = Field(
        None,
        ge=0,
        description="serve on the listening socket inherited as file descriptor N (bound by "
        "the parent: a supervisor, systemd socket activation, a test), instead of "
        "--host/--port",
        json_schema_extra={"metavar": "N"},
    )
    engine: Literal["vllm", "sim", "sim-batch"] = Field(
        "vllm",
        description="vllm: a real vLLM AsyncLLM engine; sim: the continuous-batching timing "
        "model; sim-batch: the fixed-time batch model",
    )
    model: str | None = Field(
        None,
        description="model path or id for vllm (default: the demo model in the cache directory)",
    )
    served_model_name: str | None = Field(
        None,
        description="model name clients use (default: 'sluice-demo' for the demo model, else "
        "--model)",
    )
    engine_arg: list[str] = Field(
        [],
        description="pass a vLLM engine argument through, e.g. max_model_len=1024 or "
        "tensor_parallel_size=8 (repeatable)",
        json_schema_extra={"metavar": "KEY=VALUE"},
    )
    kv_events_config: str | None = Field(
        None,
        description="vLLM's KV-event publisher, as vLLM's server takes it (JSON), e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv-events"}\': what vllm-router --policy kv_aware reads',
        json_schema_extra={"metavar": "JSON"},
    )
    lora_modules: list[str] = Field(
        [],
        description="LoRA adapters served as models of their own, as vLLM's server takes "
        'them: NAME=PATH, or JSON {"name": ..., "path": ...} (several after the flag, '
        "or the flag again); a request's model names one",
        json_schema_extra={"metavar": "NAME=PATH", "nargs": "+"},
    )
    enable_lora: bool = Field(
        False,
        description="serve LoRA adapters: those of --lora-modules (which imply it) and those an "
        "admin key loads at runtime (POST /v1/load_lora_adapter)",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="the most distinct adapters one engine step runs, as vLLM's: Sluice's "
        "scheduler holds to it, chats first (default: --max-cpu-loras)",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="the most adapters served at once, from --lora-modules and loaded at "
        "runtime (default: --max-loras, or the --lora-modules, or 1 with --enable-lora alone)",
    )
    demo_lora: bool = Field(
        False,
        description="with the demo model: also serve its LoRA adapter, as 'sluice-demo-lora' "
        "(built in the cache directory on first use), in float32 (vLLM 0.32's CPU LoRA in "
        "bfloat16 dies on some hosts and shapes)",
    )
    max_lora_rank: int | None = Field(
        None,
        description="the largest adapter rank the engine holds (vLLM's: 8, 16, 32, 64, 128, "
        "256, 320 or 512; default 16; the demo adapter's is 8)",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool-call parser for the model's output (e.g. hermes, pythonic), "
        "as for vLLM's server; needed for any tool_choice but 'none'",
        json_schema_extra={"metavar": "NAME"},
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="let the model choose to call tools (tool_choice 'auto'), as for vLLM's server",
    )
    reasoning_parser: str | None = Field(
        None,
        description="vLLM's reasoning parser: the model's reasoning goes to 'reasoning', apart "
        "from 'content'",
        json_schema_extra={"metavar": "NAME"},
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="where the demo model lives ($SLUICE_CACHE_DIR)",
    )
    config: Path | None = Field(
        None,
        description="YAML file of tenants, API keys and scheduler limits: docs/configuration.md",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the least severe log records written"
    )
    max_body_bytes: int = Field(1 << 20, gt=0, description="largest request body accepted")
    sse_ping_seconds: float = Field(15.0, gt=0, description="SSE keep-alive interval")
    stream_coalesce: Literal["on", "off"] = Field(
        "on",
        description="on: a stream whose client reads slower than tokens come gets the waiting "
        "pieces of text merged into one chunk; off: one event per piece, whatever the backlog",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens per streamed chunk, as vLLM's --stream-interval (a request's "
        "stream_interval raises it for that request); the first and last are sent at once",
    )
    send_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="a client that accepts no bytes for this long is dropped and its request "
        "aborted",
    )
    metrics_port: Port | None = Field(
        None,
        description="serve /metrics on this port (and not on the API's): keep it off the "
        "public network",
    )
    metrics_host: str | None = Field(
        None, description="address for --metrics-port (default: --host)"
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="where the Batch API keeps its files and batches (without state.url), "
        "and the Responses API its stored responses; several processes of a host may share it",
    )
    max_file_bytes: int = Field(100 << 20, gt=0, description="largest file /v1/files accepts")
    state_url: str | None = Field(
        None,
        description="Redis URL (redis://host:6379/0) for state shared by replicas: tenant "
        "quotas hold across all of them (overrides the config's state.url)",
        json_schema_extra={"sets": "state.url"},
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="send a span per request (OpenTelemetry, OTLP) here, as vLLM's flag: a "
        "gRPC host:port or URL, or with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf a URL "
        "ending in /v1/traces (sets tracing.otlp_traces_endpoint)",
        json_schema_extra={"sets": "tracing.otlp_traces_endpoint", "metavar": "URL"},
    )
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, refuse new requests and let running generations finish for "
        "up to this long; the rest end with a 'shutting_down' error event, then Sluice exits 0",
    )
    engine_death_exit_seconds: float = Field(
        2.0,
        ge=0,
        description="after the engine dies, answer /ready and new requests with 503 for this "
        "long, then exit with status 3",
    )


def add_arguments(
    parser: argparse._ActionsContainer, options: type[BaseModel], *, prefix: str = ""
) -> None:
    """A flag per field of `options`: `--some-name` for `some_name` (with a prefix,
    `--prefix-some-name` into `prefix_some_name`), with its default and help; a value out of
    the field's type or bounds is refused by argparse, naming the flag."""
    for name, field in options.model_fields.items():
        dest = f"{prefix}_{name}" if prefix else name
        parser.add_argument(f"--{dest.replace('_', '-')}", dest=dest, **_argument(field, options))


def _argument(field: FieldInfo, options: type[BaseModel]) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    kwargs: dict[str, Any] = {"help": field.description or None}
    if "metavar" in extra:
        kwargs["metavar"] = extra["metavar"]
    default = field.get_default(call_default_factory=True)
    annotation = _without_none(field.annotation)
    if annotation is bool:
        return {**kwargs, "action": "store_true"}
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        several = {"action": "extend", "nargs": "+"} if extra.get("nargs") else {}
        return {
            **kwargs,
            "action": "append",
            "default": list(default),
            "type": _parser(item, options),
            **several,
        }
    if typing.get_origin(annotation) is Literal:
        return {**kwargs, "default": default, "choices": typing.get_args(annotation)}
    if field.is_required():  # (no default: argparse asks for the flag)
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    checked: Any = field.annotation
    if field.metadata:  # bounds (Field(gt=0)) travel with the type
        checked = Annotated[field.annotation, *field.metadata]
    return {**kwargs, "type": _parser(checked, options)}


def _parser(annotation: Any, options: type[BaseModel]) -> Callable[[str], Any]:
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)

    def parse(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(describe(exc.errors()[0], options)) from None

    return parse


def _without_none(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, type(int | None)) and len(args) == 1:
        return args[0]
    return annotation


def config_flags(options: ServeOptions) -> dict[str, Any]:
    """The configuration the flags set (`--state-url` -> `state.url`), as a layer."""
    layer: dict[str, Any] = {}
    for name, field in ServeOptions.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        value = getattr(options, name)
        if "sets" in extra and value is not None:
            *sections, key = str(extra["sets"]).split(".")
            target = layer
            for section in sections:
                target = target.setdefault(section, {})
            target[key] = value
    return layer


class _Environment(EnvSettingsSource):
    """`SLUICE_<SECTION>__<KEY>` variables of `environ` as a layer; SLUICE_API_KEYS as given
    (`key:tenant,...`, not JSON)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        super().__init__(
            SluiceConfig,  # type: ignore[arg-type]  # a model, read without BaseSettings' env
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter="__",
        )
        self.env_vars = {
            key.lower(): None if value == "null" else value for key, value in environ.items()
        }

    def prepare_field_value(
        self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool
    ) -> Any:
        if field_name == "api_keys":
            return value
        return super().prepare_field_value(field_name, field, value, value_is_complex)


def read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if loaded is not None and not isinstance(loaded, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded or {}


def load_config(
    path: Path | None,
    environ: Mapping[str, str] = os.environ,
    flags: Mapping[str, Any] | None = None,
) -> SluiceConfig:
    """The configuration from its layers: defaults, the YAML file at `path` (if any), the
    `SLUICE_*` variables of `environ`, then `flags` (`config_flags`). A ConfigError names the
    layer and the path of what it refuses."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path is not None:
        layers.append((str(path), read_yaml(path)))
    layers.append(("environment", _Environment(environ)()))
    layers.append(("flags", flags or {}))
    merged: dict[str, Any] = {}
    config = None
    for source, layer in layers:
        if not layer and config is not None:
            continue
        merged = _merged(merged, layer)
        try:
            config = parse_config(merged)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    assert config is not None
    return config


def _merged(below: Mapping[str, Any], above: Mapping[str, Any]) -> dict[str, Any]:
    """`above` over `below`: mappings key by key, anything else replaced."""
    merged = dict(below)
    for key, value in above.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged
