"""The `sluice` command: serve, fleet, demo-model, simulate, plan."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from server.core import last_exit
from server.core.settings import ServeOptions, add_arguments

if TYPE_CHECKING:
    from server.api.serving import ServeCommand

# First: the handler atexit runs last (after every library's), for `sluice serve`.
last_exit.install()


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
    add_arguments(p, ServeOptions)
    from engine_adapters.sim import add_sim_arguments

    add_sim_arguments(p)
    from server.fixed_batch.cli import add_serve_arguments as add_batch_serve_arguments

    add_batch_serve_arguments(p)


def _add_fleet(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fleet",
        help="Redis, several `sluice serve` replicas and vLLM's router, on this host",
        description="A local fleet in one command: Redis (unless --state-url), N replicas of "
        "`sluice serve` sharing it, and vllm-router in front, as the deployments run them. "
        "Arguments after -- go to every replica, e.g. `sluice fleet -- --engine sim`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from server.fleet import add_fleet_arguments

    add_fleet_arguments(p)


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
    from server.simulation.workload import ArrivalOptions

    add_arguments(p, ArrivalOptions)
    from server.fixed_batch.cli import add_simulate_arguments as add_batch
    from server.simulation.continuous import add_simulate_arguments as add_continuous

    add_continuous(p)
    add_batch(p)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from server.fixed_batch.cli import add_plan_parser

    add_plan_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: a streaming token server with a scheduler in front of an LLM engine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_fleet(sub)
    _add_demo_model(sub)
    _add_simulate(sub)
    _add_plan(sub)
    return parser


def serve_command(args: argparse.Namespace) -> ServeCommand:
    """`sluice serve`'s parsed arguments as one typed, frozen object: nothing past the command
    line reads the Namespace. An engine's own flags are read only when it is the one served."""
    from server.api.serving import ServeCommand

    options = ServeOptions.model_validate(vars(args))
    if options.engine == "sim":
        from engine_adapters.sim import SimConfig

        return ServeCommand(options, sim=SimConfig.from_args(args))
    if options.engine == "sim-batch":
        from server.fixed_batch.cli import BatchShape

        return ServeCommand(options, batch=BatchShape.model_validate(vars(args)))
    return ServeCommand(options)


def parse_serve(argv: Sequence[str]) -> ServeCommand:
    """`sluice serve ARGV` as the command reads it (its parser, then `serve_command`)."""
    return serve_command(build_parser().parse_args(["serve", *argv]))


def simulate(args: argparse.Namespace) -> int:
    """`sluice simulate`: its flags as each mode's typed options, then the mode's run."""
    from pydantic import ValidationError

    from server.simulation.workload import ArrivalOptions

    arrivals = ArrivalOptions.model_validate(vars(args))
    if args.mode == "batch":
        from server.fixed_batch.cli import BatchFaults, BatchShape, run_simulate

        shape, faults = (
            BatchShape.model_validate(vars(args)),
            BatchFaults.model_validate(vars(args)),
        )
        return run_simulate(arrivals, shape, faults, as_json=args.json)
    from engine_adapters.sim import SimConfig
    from server.simulation.continuous import ContinuousOptions, run
    from server.simulation.host import HostConfig

    try:
        host = HostConfig.from_args(args)
    except ValidationError as exc:  # (one rule across flags: argparse checked each alone)
        print(f"sluice simulate: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    options = ContinuousOptions.model_validate(vars(args))
    return run(arrivals, options, SimConfig.from_args(args), host, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from server.api import terminal

        if terminal.in_terminal() and args.fd is None:
            return terminal.supervise(sys.argv[1:] if argv is None else argv)
        terminal.die_with_parent()
        from server.api.serving import serve

        return serve(serve_command(args))
    if args.command == "fleet":
        from server.fleet import FleetOptions, run

        return run(FleetOptions.model_validate(vars(args)), args.serve_args or ())
    if args.command == "demo-model":
        from engine_adapters.demo_model import build_demo_model

        path = build_demo_model(args.path, force=args.force)
        print(path)
        return 0
    if args.command == "simulate":
        return simulate(args)
    if args.command == "plan":
        from server.fixed_batch.cli import PlanOptions, run_plan

        return run_plan(PlanOptions.model_validate(vars(args)), as_json=args.json)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
