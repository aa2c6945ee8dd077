"""The SLO verdict of each request, and the counters that carry it, on a real sim server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from server.errors import DeadlineUnmeetable, Overloaded, TenantQuotaExceeded
from server.metrics import SLO_RESULTS
from server.scheduler.types import SloTargets
from server.timeline import slo_result

from .conftest import run_sluice

TARGETS = SloTargets(ttft_s=0.1, itl_s=0.01)


@pytest.mark.parametrize(("outcome", "error", "ttft", "itl", "targets", "expected"), [
    ("completed", None, 0.05, 0.005, TARGETS, ("met", "none")),
    ("completed", None, 0.15, 0.020, TARGETS, ("missed", "ttft")),  # the first promise broken
    ("completed", None, 0.05, 0.020, TARGETS, ("missed", "itl")),
    ("completed", None, 0.05, None, TARGETS, ("met", "none")),  # one token: no gap to judge
    ("completed", None, 9.0, 9.0, None, ("met", "none")),  # bulk: no latency targets
    ("expired", None, None, None, TARGETS, ("missed", "expired")),
    ("failed", None, 0.05, None, None, ("missed", "failed")),
    ("rejected", Overloaded("full"), None, None, TARGETS, ("missed", "refused")),
    ("rejected", DeadlineUnmeetable("late"), None, None, None, ("missed", "refused")),
    ("rejected", TenantQuotaExceeded("quota"), None, None, TARGETS, None),  # the tenant's own
    ("invalid", None, None, None, TARGETS, None),
    ("cancelled", None, 0.05, None, TARGETS, None),  # left after a timely first token
])
def test_each_ending_gets_one_verdict(outcome, error, ttft, itl, targets, expected) -> None:  # type: ignore[no-untyped-def]
    assert slo_result(outcome, error, 1.0, ttft, itl, targets) == expected


def test_a_client_that_gave_up_waiting_past_the_ttft_target_counts_as_missed() -> None:
    assert slo_result("cancelled", None, 0.5, None, None, TARGETS) == ("missed", "ttft")
    assert slo_result("cancelled", None, 0.05, None, None, TARGETS) is None


def _chat(url: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})


def test_the_server_counts_every_verdict_from_zero(tmp_path: Path) -> None:
    # A TTFT target no answer can meet, and a gap target every answer meets.
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({"slo": {"interactive": {"ttft_ms": 0.001, "itl_ms": 60000}}}))
    with run_sluice(tmp_path, "--config", str(config)) as server:
        def count(tc: str, result: str, reason: str) -> float:
            return server.metric_sum("sluice_slo_requests_total", traffic_class=tc,
                                     result=result, reason=reason)

        text = server.metrics_text()
        for tc, verdicts in SLO_RESULTS.items():  # every series exists before any request
            for result, reason in verdicts:
                assert (f'sluice_slo_requests_total{{model="sim",reason="{reason}",'
                        f'result="{result}",traffic_class="{tc}"}} 0.0') in text
        for name in ("sluice_rejections_total", "sluice_cancellations_total",
                     "sluice_engine_aborts_total", "sluice_deadline_misses_total"):
            assert f"\n{name}{{" in text, name
        assert _chat(server.base_url).status_code == 200
        assert count("interactive", "missed", "ttft") == 1
        assert _chat(server.base_url, **{"X-Traffic-Class": "bulk"}).status_code == 200
        assert count("bulk", "met", "none") == 1
        refused = _chat(server.base_url, **{"X-Request-Timeout-Ms": "0.01"})
        assert refused.json()["error"]["code"] == "deadline_unmeetable"
        assert count("interactive", "missed", "refused") == 1
        assert server.metric_sum("sluice_slo_target_seconds", target="ttft") == 0.000001
        assert server.metric_sum("sluice_slo_target_seconds", target="itl") == 60.0
        assert server.metric_sum("sluice_bulk_cap_sequences") >= 1
        assert server.metric_sum("sluice_knee_sequences") >= 1
