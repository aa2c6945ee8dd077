"""The bulk controller against the frontier in virtual time, over several seeds.

`tests/simulation/test_frontier.py` asserts, for one seed of each simulated host, that the
controller told the SLO keeps 95% of chats within it with bulk at 0.9x the best fixed cap.
This runs the same hosts, the same load and the same judgement (the test's own functions, so
the two cannot drift apart) for as many seeds as asked, and prints, per host and seed: the
frontier (the best fixed cap's bulk tokens/s that keeps 95% of chats), then the controller
told the SLO and the default configuration, each as its share of chats within the SLO, its
bulk against the frontier, and the bulk requests it stopped. Seeds other than the test's show
how far a change holds beyond the one arrival pattern the test sees.

    python bench/frontier_sim.py                                    # every host, seeds 1-4
    python bench/frontier_sim.py --hosts "cpu line;this host's curve" --seeds 1,2,3,4,5,6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.simulation import test_frontier as frontier


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", default=";".join(frontier.CASES), help="';'-separated host names")
    p.add_argument("--seeds", default="1,2,3,4", help="','-separated arrival seeds")
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
                share, bulk = frontier.judged(fixed, slo, case.seconds)
                if share >= 0.95:
                    kept.append(bulk)
            best = max(kept, default=float("nan"))
            cells = []
            for label, config in (("told the SLO", frontier.stated(slo)), ("default", {})):
                simulation = frontier.run(case, config, seed=seed)
                share, bulk = frontier.judged(simulation, slo, case.seconds)
                stops = sum(simulation.core.preempted_for.values())
                cells.append(f"{label} {100 * share:.1f}%, {bulk / best:.2f}x, {stops} stops")
            print(
                f"{name}, seed {seed}: frontier {best:.0f} tok/s | " + " | ".join(cells),
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
