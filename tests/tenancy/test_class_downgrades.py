"""A class the tenant may not use is served in its default class, and counted where operators
see it: `sluice_traffic_class_downgrades_total{tenant, asked}`."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import sim_sluice
from prometheus_client.parser import text_string_to_metric_families

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TENANTS = """
tenants:
  batchco: {api_keys: [sk-batch-1], allowed_classes: [bulk]}
  acme: {api_keys: [sk-acme-1]}
"""


def test_a_downgraded_request_is_served_and_counted_by_tenant_and_asked_class(
    tmp_path: Path,
) -> None:
    with sim_sluice(tmp_path, config=TENANTS, log="s.log") as server:

        def chat(key: str, traffic_class: str) -> None:
            headers = {"authorization": f"Bearer {key}", "x-traffic-class": traffic_class}
            reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert reply.status_code == 200

        def downgrades(tenant: str, asked: str) -> float:
            return server.metric(
                "sluice_traffic_class_downgrades_total", tenant=tenant, asked=asked
            )

        exposed = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        series = {
            (sample.labels["tenant"], sample.labels["asked"]): sample.value
            for family in exposed
            if family.name == "sluice_traffic_class_downgrades"
            for sample in family.samples
        }
        tenants, classes = ("batchco", "acme", "other"), ("interactive", "bulk")
        assert series == {(t, c): 0.0 for t in tenants for c in classes}  # from the start
        chat("sk-batch-1", "interactive")
        chat("sk-batch-1", "interactive")
        chat("sk-batch-1", "bulk")
        chat("sk-acme-1", "interactive")
        assert downgrades("batchco", "interactive") == 2
        assert downgrades("batchco", "bulk") == 0
        assert downgrades("acme", "interactive") == 0
        assert server.metric("sluice_requests_total", traffic_class="bulk") == 3
