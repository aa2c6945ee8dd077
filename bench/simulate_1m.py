"""How long the continuous simulator takes for a million requests, and the memory it holds.

    .venv/bin/python bench/simulate_1m.py [--duration 1000] [--rate 1000]

Runs, as a subprocess (so that its peak RSS is its own):

    python -m server.cli simulate --mode continuous --workload poisson --rate 1000
        --duration 1000 --max-tokens 16 --prompt-tokens 32

Poisson chats at 1,000/s for 1,000 virtual seconds (about 1,000,000 requests) on the default
sim engine, which serves about 420 of them a second: the rest are refused. Prints the wall
seconds of the whole process (start-up included), requests per wall second and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1000.0, help="virtual seconds")
    parser.add_argument("--rate", type=float, default=1000.0, help="arrivals per second")
    args = parser.parse_args()
    command = [
        sys.executable,
        "-m",
        "server.cli",
        "simulate",
        "--mode",
        "continuous",
        "--workload",
        "poisson",
        "--rate",
        str(args.rate),
        "--duration",
        str(args.duration),
        "--max-tokens",
        "16",
        "--prompt-tokens",
        "32",
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - started
    summary = json.loads(done.stdout)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    requests = summary["requests"]
    print(
        f"{requests:,} requests in {wall_s:.1f} s wall ({requests / wall_s:,.0f} requests/s; "
        f"the simulation loop alone {summary['wall_seconds']:.1f} s), peak RSS {peak_rss_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
