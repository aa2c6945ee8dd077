"""How long the batch simulator takes for a million requests.

    .venv/bin/python bench/batch_simulate.py [--requests 1000000] [--workers 5] [--rate 1000]

Poisson arrivals at --rate for as long as it takes to reach --requests, fixed 100 ms batches of
up to 32, 10 ms batching delay. Prints the wall time and the simulated figures.
"""

from __future__ import annotations

import argparse
import time

from server.core.stats import quantile
from server.fixed_batch.decisions import BatchConfig
from server.fixed_batch.plan import latencies_ms
from server.fixed_batch.simulate import simulate
from server.simulation.workload import DEFAULT_MODEL, poisson_arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = BatchConfig(
        workers=(DEFAULT_MODEL,) * args.workers,
        batch_time_s=0.1,
        max_batch=32,
        max_delay_s=0.010,
        max_queue=10**9,
    )
    arrivals = poisson_arrivals(args.rate, args.requests / args.rate, seed=args.seed)
    started = time.perf_counter()
    result = simulate(config, arrivals, keep_batches=False)
    elapsed = time.perf_counter() - started
    lat = latencies_ms(result)
    print(
        f"simulated {len(result.requests):,} requests in {elapsed:.2f} s wall "
        f"({len(result.requests) / elapsed:,.0f} requests/s)"
    )
    print(
        f"{args.workers} workers at {args.rate:g} req/s: mean batch "
        f"{result.mean_batch_size:.2f}, p50 {quantile(lat, 0.5):.1f} ms, "
        f"p99 {quantile(lat, 0.99):.1f} ms"
    )


if __name__ == "__main__":
    main()
