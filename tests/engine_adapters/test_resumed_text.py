"""A resumed generation's text continues exactly where its earlier tokens' text stopped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_adapters.vllm_adapter import ResumedText

# transformers (torch with it) imported in this process: with the other tests that import
# vLLM's library (tests/engine_adapters/test_vllm_stats.py), in one worker.
pytestmark = pytest.mark.xdist_group("vllm_library")


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer  # here, not at collection: its import takes seconds

    return AutoTokenizer.from_pretrained(str(demo_model_dir))


def seen_before_preemption(tokenizer, ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    """What a client had received: the text so far, less a character not yet complete."""
    return str(tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")


def resumed(tokenizer, earlier: list[int], later: list[int], step: int) -> str:  # type: ignore[no-untyped-def]
    text = ResumedText(tokenizer, earlier, skip_special_tokens=True)
    parts = [
        text.add(later[i : i + step], finished=i + step >= len(later))
        for i in range(0, len(later), step)
    ]
    return "".join(parts)


def test_text_across_a_resumption_equals_the_uninterrupted_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    # The demo model's gibberish: any token, stray bytes included, cut at any point.
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(2, 40))]
        cut = rng.randrange(1, len(ids))
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        text = seen_before_preemption(tokenizer, ids[:cut]) + resumed(
            tokenizer, ids[:cut], ids[cut:], step=rng.choice((1, 2, 3))
        )
        assert text == whole, (ids, cut)


def test_a_character_cut_in_half_by_the_resumption_is_completed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("naïve 好的 ok", add_special_tokens=False)
    for cut in range(1, len(ids)):
        text = seen_before_preemption(tokenizer, ids[:cut]) + resumed(
            tokenizer, ids[:cut], ids[cut:], step=1
        )
        assert text == "naïve 好的 ok"
