"""Every adapter's model info carries what the scheduler plans with: seats, the per-step token
budget, the KV cache; none can be left out."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from conftest import SluiceProcess

from engine_adapters.protocol import EngineLimits, KVCacheInfo, ModelInfo
from engine_adapters.sim import SimEngine
from engine_adapters.sim_batch import BatchModel, SimBatchEngine
from engine_adapters.sim_model import SimConfig
from server.core.config import parse_config
from server.scheduler.budgets import BudgetLimits

THIRTY_TWO_SEATS = SimConfig(max_num_seqs=32, max_batched_tokens=512, kv_blocks=64, block_size=32)


def test_sim_reports_the_seats_it_was_configured_with() -> None:
    info = SimEngine(THIRTY_TWO_SEATS, model_name="sim-32").model
    assert info.path == "sim-32"
    assert info.limits == EngineLimits(
        max_num_seqs=32, max_batched_tokens=512, kv_cache=KVCacheInfo(32, 64), adapter_slots=0
    )
    # The discrete-event simulator plans with the same model info as the server's engine.
    assert THIRTY_TWO_SEATS.model_info("sim-32") == info


def test_sim_batch_reports_one_batch_as_its_seats() -> None:
    info = SimBatchEngine(BatchModel(max_batch=8), name="b", max_model_len=1024).model
    assert info.limits.max_num_seqs == 8
    # A fixed batch holds each of its sequences whole.
    assert info.limits.kv_cache.num_blocks * info.limits.kv_cache.block_size == 8 * 1024


def test_limits_are_required_and_never_zero() -> None:
    with pytest.raises(TypeError):
        ModelInfo(name="m", path="m", max_model_len=16)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="engine limits"):
        EngineLimits(
            max_num_seqs=0, max_batched_tokens=16, kv_cache=KVCacheInfo(16, 4), adapter_slots=0
        )
    with pytest.raises(ValueError, match="engine limits"):
        EngineLimits(
            max_num_seqs=8, max_batched_tokens=16, kv_cache=KVCacheInfo(16, 4), adapter_slots=-1
        )


@pytest.mark.parametrize("configured", [8, 32, 256, 1024])
def test_the_sequences_budget_never_exceeds_the_engine_seats(configured: int) -> None:
    config = parse_config({"budgets": {"max_running_seqs": configured}})
    limits = BudgetLimits.from_engine(config.budgets, THIRTY_TWO_SEATS.model_info("sim"))
    assert limits.sequences == min(configured, 32)


def test_vllm_reports_its_weights_and_seats(
    vllm_server: SluiceProcess, demo_model_dir: Path
) -> None:
    model = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]
    assert model["root"] == str(demo_model_dir)
    # The adapter logs the limits it read from vLLM's config; the scheduler plans with them.
    seats = re.search(r"max_num_seqs=(\d+)", vllm_server.log_path.read_text(errors="replace"))
    assert seats is not None
    budget = vllm_server.metric("sluice_budget_limit", budget="sequences")
    assert budget == min(int(seats.group(1)), parse_config({}).budgets.max_running_seqs)
