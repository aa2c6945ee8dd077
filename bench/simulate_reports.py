"""The continuous simulator's reports for a set of command lines, to compare two versions of
the code byte for byte (a speed-up must not change a report).

    .venv/bin/python bench/simulate_reports.py OUT_DIR

Writes one `<name>.json` per command line into OUT_DIR, with `wall_seconds` set to 0 (the only
figure that differs from run to run). It runs the checkout it lies in: run it from both (copy
it into an older one), then `diff -r DIR_A DIR_B`. The lines cover the 1M run's shape, mixed
load with bulk streams (preemptions, tenant refusals), bursts, an end-of-sequence probability,
cancellations of queued and running requests, and a small KV cache (the engine preempts).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each line's flags after `sluice simulate --mode continuous`.
COMMANDS = {
    "poisson_1m_shape": "--workload poisson --rate 1000 --duration 50 --max-tokens 16 "
    "--prompt-tokens 32",
    "poisson_1m_shape_json": "--json --workload poisson --rate 1000 --duration 20 "
    "--max-tokens 16 --prompt-tokens 32",
    "mixed_bulk_streams": "--json --workload mixed --bulk-streams 8 --duration 20 --rate 50",
    "mixed_preempting": "--workload mixed --bulk-streams 8 --duration 60 --rate 200 --seed 3",
    "bursts": "--json --workload bursts --duration 20 --rate 100",
    "bursts_eos": "--workload bursts --duration 30 --rate 400 --burst-size 50 --seed 7 "
    "--sim-eos-probability 0.05",
    "trace_cancel": "--json --arrivals A@0,B@7,E@1:deadline=150,C@3,D@4,F@20,G@21 "
    "--cancel B@30 --cancel F@25 --cancel A@1",
    "mixed_cancel": "--json --workload mixed --duration 5 --rate 100 --bulk-streams 4 "
    "--cancel bulk0.0@500 --cancel bulk1.2@3000",
    "small_kv_cache": "--json --workload mixed --duration 10 --rate 80 --bulk-streams 16 "
    "--sim-kv-blocks 40 --sim-block-size 16 --sim-max-num-seqs 32 --sim-max-model-len 512 "
    "--bulk-prompt-tokens 100 --bulk-max-tokens 100",
}

_WALL = re.compile(r'"wall_seconds": [0-9.e+-]+')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, flags in COMMANDS.items():
        command = [sys.executable, "-m", "server.cli", "simulate", "--mode", "continuous"]
        command += flags.split()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        report = _WALL.sub('"wall_seconds": 0', done.stdout)
        (args.out_dir / f"{name}.json").write_text(report)
        print(f"{name}: {len(report):,} bytes")


if __name__ == "__main__":
    main()
