"""The `sluice` command: serve, demo-model, simulate, plan."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the HTTP/SSE/WebSocket server",
        description=(
            "Serve an OpenAI-compatible API (SSE streaming) and a WebSocket API in front of an "
            "LLM engine. With no arguments: the vLLM engine on CPU with the demo model, built "
            "on first run into the cache directory, on http://127.0.0.1:8000."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--fd",
        type=int,
        default=None,
        metavar="N",
        help="serve on the listening socket inherited as file descriptor N (bound by the "
        "parent: a supervisor, systemd socket activation, a test), instead of --host/--port",
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "sim", "sim-batch"),
        default="vllm",
        help="vllm: a real vLLM AsyncLLM engine; sim: the continuous-batching timing model; "
        "sim-batch: the fixed-time batch model",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model path or id for vllm (default: the demo model in the cache directory)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: 'sluice-demo' for the demo model, else --model)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="pass a vLLM engine argument through, e.g. max_model_len=1024 or "
        "tensor_parallel_size=8 (repeatable)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="vLLM's tool-call parser for the model's output (e.g. hermes, pythonic), as for "
        "vLLM's server; needed for any tool_choice but 'none'",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model choose to call tools (tool_choice 'auto'), as for vLLM's server",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="vLLM's reasoning parser: the model's reasoning goes to 'reasoning', apart from "
        "'content'",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the demo model lives"
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML file with tenants, API keys and scheduler limits (see README)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body accepted",
    )
    p.add_argument("--sse-ping-seconds", type=float, default=15.0, help="SSE keep-alive interval")
    p.add_argument(
        "--send-timeout-seconds",
        type=float,
        default=30.0,
        help="a client that accepts no bytes for this long is dropped and its request aborted",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port (and not on the API's): keep it off the public network",
    )
    p.add_argument(
        "--metrics-host", default=None, help="address for --metrics-port (default: --host)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="where the Batch API keeps its files and batches (one process per directory)",
    )
    p.add_argument(
        "--max-file-bytes", type=int, default=100 << 20, help="largest file /v1/files accepts"
    )
    p.add_argument(
        "--state-url",
        default=None,
        help="Redis URL (redis://host:6379/0) for state shared by replicas: tenant quotas "
        "hold across all of them (overrides the config's state.url)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, refuse new requests and let running generations finish for up to "
        "this long; the rest end with a 'shutting_down' error event, then Sluice exits 0",
    )
    p.add_argument(
        "--engine-death-exit-seconds",
        type=float,
        default=2.0,
        help="after the engine dies, answer /ready and new requests with 503 for this long, "
        "then exit with status 3",
    )
    from engine_adapters.sim import add_sim_arguments

    add_sim_arguments(p)
    try:
        from server.batching.cli import add_serve_arguments as add_batch_serve_arguments
    except ImportError:  # batch mode not installed in this tree
        pass
    else:
        add_batch_serve_arguments(p)


def _add_demo_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo-model",
        help="build the tiny random-weight Llama used by default",
        description="Build, deterministically and offline, a tiny Llama with random weights, a "
        "byte-level BPE tokenizer and a chat template at PATH.",
    )
    p.add_argument("path", type=Path)
    p.add_argument("--force", action="store_true", help="rebuild even if PATH holds a model")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="drive the scheduler in virtual time",
        description="Run the scheduler core against a simulated engine on a virtual clock.",
    )
    p.add_argument("--mode", choices=("continuous", "batch"), default="continuous")
    p.add_argument("--json", action="store_true", help="print per-request timelines as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrivals",
        default=None,
        help='explicit trace, e.g. "A@0,B@7,E@1:deadline=150" (times in ms)',
    )
    p.add_argument("--workload", choices=("poisson", "bursts", "mixed"), default=None)
    p.add_argument("--rate", type=float, default=100.0, help="arrivals per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of generated arrivals")
    try:
        from server.simulation.continuous import add_arguments as add_continuous
    except ImportError:
        pass
    else:
        add_continuous(p)
    try:
        from server.batching.cli import add_simulate_arguments as add_batch
    except ImportError:
        pass
    else:
        add_batch(p)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    try:
        from server.batching.cli import add_plan_parser
    except ImportError:
        return
    add_plan_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: a streaming token server with a scheduler in front of an LLM engine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_demo_model(sub)
    _add_simulate(sub)
    _add_plan(sub)
    return parser


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/sluice, else ~/.local/share/sluice."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from server.serving import serve

        return serve(args)
    if args.command == "demo-model":
        from engine_adapters.demo_model import build_demo_model

        path = build_demo_model(args.path, force=args.force)
        print(path)
        return 0
    if args.command == "simulate":
        if args.mode == "batch":
            from server.batching.cli import run_simulate

            return run_simulate(args)
        from server.simulation.continuous import run

        return run(args)
    if args.command == "plan":
        from server.batching.cli import run_plan

        return run_plan(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
