"""What the routes are handed when the app is built (`build_app`): each route takes its
services as its first argument, and nothing is fetched from `app.state`."""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapters.protocol import EngineClient
from server.api.edge import Edge
from server.batch_api.runner import BatchRunner
from server.batch_api.store import BatchStore
from server.generations.planner import Planner
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.observability.access_log import Api
from server.observability.metrics import Metrics
from server.responses_api.service import Responses


@dataclass(frozen=True, slots=True)
class BatchServices:
    """The Batch API's: its files and batches, and the runner that runs their lines."""

    store: BatchStore
    runner: BatchRunner
    max_file_bytes: int = 100 << 20


@dataclass(slots=True)
class Services:
    engine: EngineClient
    planner: Planner
    generations: Generations
    edge: Edge
    metrics: Metrics
    started: int  # when the app was built (the models list's `created`)
    batches: BatchServices | None = None
    responses: Responses | None = None  # OpenAI's Responses API
    ready: bool = False  # the engine and the scheduler are up, and the engine is healthy

    @property
    def served_model(self) -> str:
        return self.planner.served_model

    def timeline(self, request_id: str, api: Api) -> RequestTimeline:
        """A request's stopwatch, from now, recording into the app's metrics."""
        return RequestTimeline(
            request_id=request_id, model=self.served_model, api=api, metrics=self.metrics
        )
