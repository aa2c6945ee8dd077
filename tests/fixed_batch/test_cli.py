"""`sluice simulate --mode batch` and `sluice plan` through the real command line."""

from __future__ import annotations

import json

import pytest

from server.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


EXERCISE = (
    "simulate",
    "--mode",
    "batch",
    "--workers",
    "1",
    "--max-batch",
    "4",
    "--max-delay-ms",
    "10",
    "--batch-ms",
    "100",
    "--json",
)


def rows(out: dict) -> dict[str, tuple]:
    return {
        r["id"]: (r["arrival_ms"], r["dispatch_ms"], r["finish_ms"], r["outcome"], r["worker"])
        for r in out["requests"]
    }


def test_simulate_sparse_arrivals_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, *EXERCISE, "--arrivals", "A@0,B@7")
    assert rows(out) == {
        "A": (0.0, 10.0, 110.0, "completed", 0),
        "B": (7.0, 10.0, 110.0, "completed", 0),
    }


def test_simulate_busy_worker_and_deadline_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, *EXERCISE, "--arrivals", "A@0,B@0,C@0,D@0,E@1")
    assert rows(out)["E"] == (1.0, 100.0, 200.0, "completed", 0)
    out = run_json(capsys, *EXERCISE, "--arrivals", "A@0,B@0,C@0,D@0,E@1:deadline=150")
    e = next(r for r in out["requests"] if r["id"] == "E")
    assert (e["outcome"], e["dispatch_ms"], e["finish_ms"], e["ended_ms"]) == (
        "rejected",
        None,
        None,
        1.0,
    )
    assert all(r["finish_ms"] == 100.0 for r in out["requests"] if r["id"] != "E")


def test_simulate_poison_and_kill_flags(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        *EXERCISE,
        "--workers",
        "2",
        "--kill",
        "1@50",
        "--arrivals",
        "A@0,B@0,C@0:prompt=POISON,D@0,E@0,F@0,G@0,H@0",
    )
    outcomes = {r["id"]: r["outcome"] for r in out["requests"]}
    assert outcomes.pop("C") == "failed"
    assert set(outcomes.values()) == {"completed"}
    assert out["summary"]["duplicate_deliveries"] == 0


def test_simulate_poisson_text_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "simulate",
                "--mode",
                "batch",
                "--workers",
                "2",
                "--workload",
                "poisson",
                "--rate",
                "200",
                "--duration",
                "2",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "mean size" in text and "p99" in text


def test_simulate_timeline_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXERCISE[:-1], "--arrivals", "A@0,B@7"]) == 0
    text = capsys.readouterr().out
    assert "10.000 ms  worker 0 starts batch 0 (2 requests)" in text
    assert "110.000 ms  B completes after 103 ms" in text


def test_simulate_rejects_a_bad_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXERCISE, "--arrivals", "A@x"]) == 2
    assert "A@x" in capsys.readouterr().out


def test_plan_reproduces_the_design_problem_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "plan",
        "--rate",
        "1000",
        "--batch-ms",
        "100",
        "--max-batch",
        "32",
        "--p99-ms",
        "200",
        "--duration",
        "10",
        "--json",
    )
    assert out["per_worker_rps"] == 320
    assert out["min_workers"] == 4
    by_workers = {c["workers"]: c for c in out["candidates"]}
    assert round(by_workers[4]["utilization"], 2) == 0.78
    assert by_workers[5]["utilization"] == 0.625
    for c in out["candidates"]:
        assert set(c) >= {"workers", "utilization", "p50_ms", "p99_ms", "mean_batch_size"}
        assert c["p50_ms"] <= c["p99_ms"]
    assert by_workers[4]["p99_ms"] > by_workers[5]["p99_ms"]
    half = next(row for row in out["batch_size_table"] if row["batch_size"] == 16)
    assert half["per_worker_rps"] == 160
    assert out["recommended_workers"] == min(
        c["workers"] for c in out["candidates"] if c["p99_ms"] <= 200
    )


def test_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--rate", "1000", "--duration", "5"]) == 0
    text = capsys.readouterr().out
    assert "320 req/s" in text and "Minimum workers: 4" in text and "62.5%" in text
