"""What the routes are handed when the app is built (`build_app`): each route takes these
services as its first argument (and an API's own after them: the Responses API's, the Batch
API's), and nothing is fetched from `app.state`."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from engine_adapters.protocol import EngineClient
from server.generations.parsed import ParsedRequest
from server.generations.planner import Planner
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.http.edge import Edge, request_id_from, trace_parent_from
from server.http.ignored import IgnoredFields
from server.observability.access_log import Api
from server.observability.metrics import Metrics
from server.observability.tracing import TraceParent
from server.openai_wire.requests import REQUEST_MODELS
from server.openai_wire.wire import WireModel, ignored_fields


@dataclass(slots=True)
class Services:
    engine: EngineClient
    planner: Planner
    generations: Generations
    edge: Edge
    metrics: Metrics
    started: int  # when the app was built (the models list's `created`)
    ready: bool = False  # the engine and the scheduler are up, and the engine is healthy
    served: frozenset[str] = frozenset()  # the parts of the API the app serves (`Parts`)
    ignored: IgnoredFields = field(init=False)

    def __post_init__(self) -> None:
        self.ignored = IgnoredFields(self.metrics)

    @property
    def served_model(self) -> str:
        return self.planner.served_model

    def note_ignored(self, api: str, endpoint: str, body: WireModel | ParsedRequest) -> None:
        """Count, and log once an app, the fields `body` (validated) ignores."""
        if isinstance(body, ParsedRequest):
            fields, declared = body.ignored, REQUEST_MODELS[body.kind].model_fields
        else:
            fields, declared = ignored_fields(body), type(body).model_fields
        self.ignored.note(api, endpoint, fields, declared)

    def timeline(self, request_id: str, api: Api, trace: TraceParent | None) -> RequestTimeline:
        """A request's stopwatch, from now, recording into the app's metrics (and its span,
        with tracing on, a child of `trace`'s)."""
        return self.generations.timeline(request_id, api, trace)

    def timeline_of(self, request: HTTPConnection, api: Api) -> RequestTimeline:
        """An HTTP request's stopwatch: its X-Request-Id (if sane) and its trace context."""
        headers = request.headers
        return self.timeline(
            request_id_from(headers.get("x-request-id")), api, trace_parent_from(headers)
        )
