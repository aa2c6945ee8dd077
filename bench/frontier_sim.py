"""The bulk controller against the frontier in virtual time, over several seeds.

`tests/simulation/test_frontier.py` asserts, for one seed of each simulated host, that the
controller told the SLO keeps 95% of chats within it with bulk at 0.9x the best fixed cap.
This runs the same hosts, the same load and the same judgement (the test's own functions, so
the two cannot drift apart) for as many seeds as asked, and prints, per host and seed: the
frontier (the best fixed cap's bulk tokens/s that keeps 95% of chats), then the controller
told the SLO and the default configuration, each as its share of chats within the SLO, its
bulk against the frontier, and the bulk requests it stopped. Seeds other than the test's show
how far a change holds beyond the one arrival pattern the test sees.

With `--runs N`, the controller's rows run N of those minutes in a row on one simulation, as
`bench/flood.py --repeat N --keep-servers` runs a kept server: each minute is judged on its
own (from its tenth second, bulk by the requests that ended in it), the first being a fresh
server's, the later ones a server that has learnt. The ladder's caps hold no state, so their
frontier is one minute's, judged the same way. (The slowdown's host stays slow after its first
run, so its later runs meet a frontier it no longer has; and bulk counted by the requests that
end in a minute says little of long prompts'.)

    python bench/frontier_sim.py                                    # every host, seeds 1-4
    python bench/frontier_sim.py --hosts "cpu line;this host's curve" --seeds 1,2,3,4,5,6
    python bench/frontier_sim.py --runs 3       # three minutes in a row on one server
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.simulation import test_frontier as frontier


def judged_minute(
    simulation: Any, slo: tuple[float, float], start: float, seconds: float
) -> tuple[float, float]:
    """`frontier.judged` for the minute from `start`: chats that arrived in it after the
    warm-up, and bulk by the requests that ended in it."""
    timelines = simulation.timelines.values()
    chats = [
        t
        for t in timelines
        if t.traffic_class == "interactive"
        and start + frontier.WARMUP <= t.arrival < start + seconds - frontier.CHATS_END
    ]
    met = sum(frontier.within(chat, slo) for chat in chats)
    bulk = sum(
        t.output_tokens
        for t in timelines
        if t.traffic_class == "bulk"
        and t.finished is not None
        and start + frontier.WARMUP <= t.finished < start + seconds
    )
    return met / len(chats), bulk / (seconds - frontier.WARMUP)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", default=";".join(frontier.CASES), help="';'-separated host names")
    p.add_argument("--seeds", default="1,2,3,4", help="','-separated arrival seeds")
    p.add_argument("--runs", type=int, default=1, help="the controller's minutes on one server")
    args = p.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    for name in args.hosts.split(";"):
        case = frontier.CASES[name]
        slo = frontier.benchmark_slo(case)
        for seed in seeds:
            started = time.monotonic()
            kept = []  # bulk tokens/s of each fixed cap that keeps 95% of chats
            for cap in frontier.LADDER:
                fixed = frontier.run(case, {"bulk_cap_sequences": cap}, seed=seed)
                if args.runs == 1:
                    share, bulk = frontier.judged(fixed, slo, case.seconds)
                else:
                    share, bulk = judged_minute(fixed, slo, 0.0, case.seconds)
                if share >= 0.95:
                    kept.append(bulk)
            best = max(kept, default=float("nan"))
            long = dataclasses.replace(case, seconds=args.runs * case.seconds)
            cells = []
            for label, config in (("told the SLO", frontier.stated(slo)), ("default", {})):
                simulation = frontier.run(long, config, seed=seed)
                if args.runs == 1:
                    share, bulk = frontier.judged(simulation, slo, case.seconds)
                    stops = sum(simulation.core.preempted_for.values())
                    cells.append(f"{label} {100 * share:.1f}%, {bulk / best:.2f}x, {stops} stops")
                    continue
                minutes = [
                    judged_minute(simulation, slo, run * case.seconds, case.seconds)
                    for run in range(args.runs)
                ]
                cells.append(
                    f"{label} " + " / ".join(f"{100 * s:.1f}%, {b / best:.2f}x" for s, b in minutes)
                )
            print(
                f"{name}, seed {seed}: frontier {best:.0f} tok/s | " + " | ".join(cells),
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
