"""Each tenant's prefix cache is its own unless configured shared, on the real vLLM engine: the
same prompt from another tenant finds nothing cached, from the same tenant its whole blocks.

What each request found cached is read from its response (`usage.prompt_tokens_details.
cached_tokens`, vLLM's count for the request's first engine step), and its access line says the
same (`cached_tokens`, matched by the request id the test sent).
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from conftest import SluiceProcess, tenant_key, wait_until

# The keyed server's tenants (tests/conftest.py): alpha and beta with caches of their own,
# gamma and delta sharing theirs.
KEYS = {name: tenant_key(name) for name in ("alpha", "beta", "gamma", "delta")}
BLOCK = 128  # vLLM's KV block on CPU: only whole blocks are cached
PROMPT = list(range(10, 10 + 2 * BLOCK + 40))  # token ids: two whole blocks and a part


@pytest.fixture
def server(keyed_vllm_server: SluiceProcess) -> SluiceProcess:
    return keyed_vllm_server


def cached(server: SluiceProcess, tenant: str) -> int:
    """The prompt's tokens found cached when `tenant` sends it."""
    request_id = uuid.uuid4().hex
    reply = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-Id": request_id},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    lines: list[dict] = []

    def logged() -> bool:
        lines[:] = [
            json.loads(line)
            for line in server.log_path.read_text().splitlines()
            if line.startswith("{") and f'"request_id":"{request_id}"' in line
        ]
        return bool(lines)

    wait_until(logged, 30, message=f"the access line of {request_id}")
    [line] = lines
    assert line["tenant"] == tenant
    found = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert line["cached_tokens"] == found
    return int(found)


def test_a_tenant_reuses_its_own_blocks_and_no_one_elses(server: SluiceProcess) -> None:
    assert cached(server, "alpha") == 0
    assert cached(server, "alpha") == 2 * BLOCK  # its own: every whole block
    assert cached(server, "beta") == 0  # the same prompt, another tenant: nothing
    assert cached(server, "beta") == 2 * BLOCK


def test_tenants_that_share_their_cache_share_it_with_each_other_only(
    server: SluiceProcess,
) -> None:
    assert cached(server, "gamma") == 0  # alpha's and beta's blocks are theirs
    assert cached(server, "delta") == 2 * BLOCK  # gamma's are shared with delta
