"""What one scheduler process would pay to hand an engine step's tokens to frontend processes.

The part of "several frontend processes per engine" that can be measured on 2 cores (see
docs/token-path.md, "Beyond one process"): per engine step, the scheduler sends each frontend
one message holding every delta of its streams (stream number, token ids, text), over a Unix
socket; the frontend reads and decodes it. This measures the CPU each side spends per token,
in two processes, for `--streams` (256) streams and `--steps` (2,000) steps, split over
`--frontends` (1) frontends:

    python bench/step_ipc.py [--streams 256] [--steps 2000] [--frontends 2]

Compare with what streaming one token costs the single process now (bench/frontend.py's
"server CPU µs/token"): the scheduler's side of the message is what would stay with it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import struct
import time

import msgspec

Delta = tuple[int, list[int], str]  # stream number, token ids, text
HEADER = struct.Struct("!I")


def frontend(sock: socket.socket, steps: int, result: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    decoder = msgspec.msgpack.Decoder(list[tuple[int, list[int], str]])
    reader = sock.makefile("rb")
    tokens = 0
    started = time.process_time()
    for _ in range(steps):
        (size,) = HEADER.unpack(reader.read(HEADER.size))
        for _, token_ids, _ in decoder.decode(reader.read(size)):
            tokens += len(token_ids)
    result.put((time.process_time() - started, tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--frontends", type=int, default=1)
    args = parser.parse_args()
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    pairs = [socket.socketpair() for _ in range(args.frontends)]
    readers = [
        multiprocessing.Process(target=frontend, args=(theirs, args.steps, results))
        for _, theirs in pairs
    ]
    for reader in readers:
        reader.start()
    encoder = msgspec.msgpack.Encoder()
    words = [" tok", " en", "s", " of", " text"]
    started = time.process_time()
    for step in range(args.steps):
        for f, (ours, _) in enumerate(pairs):
            deltas: list[Delta] = [
                (n, [1000 + step % 7000], words[(n + step) % len(words)])
                for n in range(f, args.streams, args.frontends)
            ]
            payload = encoder.encode(deltas)
            ours.sendall(HEADER.pack(len(payload)) + payload)
    sender = time.process_time() - started
    received = [results.get() for _ in readers]
    for reader in readers:
        reader.join()
    tokens = args.streams * args.steps
    assert sum(t for _, t in received) == tokens
    print(f"{args.streams} streams, {args.steps} steps, {args.frontends} frontend(s)")
    print(f"scheduler side: {1e6 * sender / tokens:.2f} µs of CPU per token (build, encode, send)")
    for i, (cpu, count) in enumerate(received):
        print(f"frontend {i}: {1e6 * cpu / count:.2f} µs of CPU per token (read, decode)")


if __name__ == "__main__":
    main()
