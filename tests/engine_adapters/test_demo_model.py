"""The demo model is decisive on the engine itself: greedy decoding never turns on a near-tie.

Every test that compares greedy text or top logprobs (streamed against whole, continued against
uninterrupted, one beam against temperature 0, embeddings against text) relies on this margin,
not on bit-exact floating point: vLLM's CPU kernels differ between AVX2 and AVX-512 machines,
between batch shapes, and between prefill and decode, by far less than GREEDY_MARGIN nats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_adapters.demo_model import GREEDY_MARGIN, is_demo_model

MODEL = "sluice-demo"


def test_the_cached_build_is_this_version(demo_model_dir: Path, tmp_path: Path) -> None:
    assert is_demo_model(demo_model_dir)
    (tmp_path / "config.json").write_text("{}")  # an older build has no version stamp
    assert not is_demo_model(tmp_path)


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_greedy_choices_lead_by_the_margin(vllm_server: Any, api: str) -> None:
    import openai  # here, not at the top: every pytest-xdist worker collects this module

    client = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0)
    ask: dict[str, Any] = dict(
        model=MODEL, max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
    )
    if api == "chat":
        reply = client.chat.completions.create(
            **ask,
            messages=[{"role": "user", "content": "Tell me about schedulers."}],
            logprobs=True,
            top_logprobs=2,
        )
        steps = [
            (e.token, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in reply.choices[0].logprobs.content or []  # type: ignore[union-attr]
        ]
    else:
        whole = client.completions.create(**ask, prompt="The queue", logprobs=2)
        logprobs = whole.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
        steps = [
            (token, sorted(top.items(), key=lambda item: -item[1]))
            for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
        ]
    assert len(steps) == 64
    for token, ranked in steps:
        first, second = ranked[0], ranked[1]
        assert token == first[0]  # greedy took the likeliest token
        assert first[1] - second[1] >= GREEDY_MARGIN, (token, first, second)
