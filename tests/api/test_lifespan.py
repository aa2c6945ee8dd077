"""The app's lifespan: each part started in turn and stopped in reverse; a part that fails to
start stops what had started before it (a vLLM engine left running would hold its processes
and memory after the server gave up)."""

from __future__ import annotations

import pytest

from engine_adapters.sim import SimConfig, SimEngine
from server.api.app import build_app
from server.api.serving import build_stores
from server.core.config import parse_config
from server.observability.metrics import Metrics
from server.scheduler.runtime import SchedulerRuntime


class RefusesToStart(SchedulerRuntime):
    async def start(self) -> None:
        raise RuntimeError("the dispatcher could not start")


async def test_a_part_that_fails_to_start_stops_the_engine_started_before_it() -> None:
    engine = SimEngine(SimConfig())
    config = parse_config({"estimates": {"calibrate": False}})
    metrics = Metrics()
    app = build_app(
        engine,
        RefusesToStart(config, engine, "sim", metrics),
        config,
        "sim",
        metrics=metrics,
        stores=build_stores(engine, config, metrics),
    )
    with pytest.raises(RuntimeError, match="could not start"):
        async with app.router.lifespan_context(app):
            pytest.fail("served with a part that did not start")
    assert not engine.is_healthy  # stopped, not left running
    assert not app.services.ready


async def test_the_app_starts_and_stops_its_parts() -> None:
    engine = SimEngine(SimConfig())
    config = parse_config({"estimates": {"calibrate": False}})
    metrics = Metrics()
    runtime = SchedulerRuntime(config, engine, "sim", metrics)
    stores = build_stores(engine, config, metrics)
    app = build_app(engine, runtime, config, "sim", metrics=metrics, stores=stores)
    async with app.router.lifespan_context(app):
        assert app.services.ready and engine.is_healthy
    assert not app.services.ready and not engine.is_healthy
