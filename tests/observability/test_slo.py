"""The SLO counters and gauges of a real sim server, from zero."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from server.observability.metrics import SLO_RESULTS

from .conftest import run_sluice


def _chat(url: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers=headers,
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    )


def test_the_server_counts_every_verdict_from_zero(tmp_path: Path) -> None:
    # A TTFT target no answer can meet, and a gap target every answer meets.
    config = tmp_path / "sluice.yaml"
    # No start-up calibration: the verdicts are counted, whatever the engine's measured speed.
    targets = {"interactive": {"ttft_ms": 0.001, "itl_ms": 60000}}
    config.write_text(yaml.safe_dump({"slo": targets, "estimates": {"calibrate": False}}))
    with run_sluice(tmp_path, "--config", str(config)) as server:

        def count(tc: str, result: str, reason: str) -> float:
            return server.metric(
                "sluice_slo_requests_total", traffic_class=tc, result=result, reason=reason
            )

        text = server.metrics_text()
        for tc, verdicts in SLO_RESULTS.items():  # every series exists before any request
            for result, reason in verdicts:
                assert (
                    f'sluice_slo_requests_total{{model="sim",reason="{reason}",'
                    f'result="{result}",traffic_class="{tc}"}} 0.0'
                ) in text
        for name in (
            "sluice_rejections_total",
            "sluice_cancellations_total",
            "sluice_engine_aborts_total",
            "sluice_deadline_misses_total",
        ):
            assert f"\n{name}{{" in text, name
        assert _chat(server.url).status_code == 200
        assert count("interactive", "missed", "ttft") == 1
        assert _chat(server.url, **{"X-Traffic-Class": "bulk"}).status_code == 200
        assert count("bulk", "met", "none") == 1
        refused = _chat(server.url, **{"X-Request-Timeout-Ms": "0.01"})
        assert refused.json()["error"]["code"] == "deadline_unmeetable"
        assert count("interactive", "missed", "refused") == 1
        assert server.metric("sluice_slo_target_seconds", target="ttft") == 0.000001
        assert server.metric("sluice_slo_target_seconds", target="itl") == 60.0
        assert server.metric("sluice_bulk_cap_sequences") >= 1
        assert server.metric("sluice_knee_sequences") >= 1


def test_a_tenants_own_targets_judge_its_chats_and_bulk_is_judged_by_its_own(
    tmp_path: Path,
) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    # Its own TTFT target, which no answer meets; its gap target the class's.
                    "tight": {"api_keys": ["key-tight"], "slo": {"ttft_ms": 0.001}},
                    "loose": {"api_keys": ["key-loose"]},
                },
                "slo": {
                    "interactive": {"ttft_ms": 60000, "itl_ms": 60000},
                    "bulk": {"itl_ms": 0.001},  # judged, never steered for: every answer misses
                },
                "estimates": {"calibrate": False},
            }
        )
    )
    with run_sluice(tmp_path, "--config", str(config)) as server:

        def count(tc: str, result: str, reason: str) -> float:
            return server.metric(
                "sluice_slo_requests_total", traffic_class=tc, result=result, reason=reason
            )

        assert _chat(server.url, Authorization="Bearer key-tight").status_code == 200
        assert count("interactive", "missed", "ttft") == 1
        assert _chat(server.url, Authorization="Bearer key-loose").status_code == 200
        assert count("interactive", "met", "none") == 1
        bulk = _chat(server.url, Authorization="Bearer key-loose", **{"X-Traffic-Class": "bulk"})
        assert bulk.status_code == 200
        assert count("bulk", "missed", "itl") == 1
        # The class's targets are exported (bulk's only where set); each stream that ended is
        # one observation of its median gap.
        assert server.metric("sluice_slo_target_seconds", traffic_class="bulk", target="itl") == (
            0.000001
        )
        for tc, streams in (("interactive", 2), ("bulk", 1)):
            assert (
                server.metric("sluice_stream_median_gap_seconds_count", traffic_class=tc) == streams
            )
        # No bulk ran beside a chat: the controller has had nothing to steer.
        assert server.metric("sluice_bulk_controller_scale") == 1.0
        aim = server.metric("sluice_bulk_controller_aim")
        assert 0 < aim < 1
        limits = [
            server.metric("sluice_bulk_controller_aim_limit", source=s)
            for s in ("spread", "misses")
        ]
        assert aim == min(limits)
        assert server.metric("sluice_bulk_controller_pace") == 1.0
