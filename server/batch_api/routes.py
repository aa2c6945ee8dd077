"""The OpenAI Files and Batch APIs: `/v1/files` (purpose `batch`) and `/v1/batches`.

Every object belongs to the tenant whose key made it; another tenant's is not found, exactly
as an unknown one. A batch's input is checked whole before it is accepted: a line that is not
JSON, a duplicate `custom_id`, another endpoint or model, or a body the request parser refuses
make the batch `failed` with `errors` naming each line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from server.batch_api.lines import LineEndpoint
from server.batch_api.runner import BatchRunner
from server.batch_api.store import Batch, BatchStore, Line, read_all
from server.batch_api.wire import CreateBatch
from server.core.errors import InvalidRequest, PayloadTooLarge, ResourceNotFound, SluiceError
from server.core.ids import new_id
from server.http.edge import context_of, trace_parent_from
from server.http.replies import JSONResponse, read_json
from server.http.services import Services
from server.openai_wire.wire import validated

WINDOWS = {"24h": 24 * 3600}
MAX_ERRORS = 100  # errors listed for a batch that failed validation


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchServices:
    """The Batch API's, handed to its routes after the services: its files and batches, and
    the runner that runs their lines."""

    store: BatchStore
    runner: BatchRunner
    max_file_bytes: int = 100 << 20


def _found(value: T | None, what: str, object_id: str) -> T:
    """`value`, or the 404 that an unknown object and another tenant's both get."""
    if value is None:
        raise ResourceNotFound(f"no {what} '{object_id}'", param=f"{what}_id")
    return value


def _tenant(services: Services, request: Request) -> str:
    """The caller's tenant."""
    return services.planner.tenant_of(context_of(request)).name


async def create_file(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    limit = api.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + 65536:
        raise PayloadTooLarge(f"the file exceeds {limit} bytes")
    try:
        form = await request.form(max_files=1, max_fields=4, max_part_size=65536)
    except Exception as exc:  # malformed multipart: python-multipart's own errors
        raise InvalidRequest(
            f"expected a multipart form with 'file' and 'purpose': {exc}"
        ) from None
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("the form has no 'file'", param="file")
    if purpose != "batch":
        raise InvalidRequest("'purpose' must be 'batch'", param="purpose")
    content = await upload.read(limit + 1)
    if len(content) > limit:
        raise PayloadTooLarge(f"the file exceeds {limit} bytes")
    return JSONResponse(
        await api.store.add_file(tenant, "batch", upload.filename or "input.jsonl", content)
    )


async def list_files(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    files = await api.store.files(tenant, request.query_params.get("purpose"))
    return JSONResponse({"object": "list", "data": files, "has_more": False})


async def get_file(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    file_id = request.path_params["id"]
    return JSONResponse(_found(await api.store.file(tenant, file_id), "file", file_id))


async def file_content(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    file_id = request.path_params["id"]
    content = _found(await api.store.file_content(tenant, file_id), "file", file_id)
    return StreamingResponse(content, media_type="application/jsonl")


async def delete_file(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    file_id = request.path_params["id"]
    _found(await api.store.delete_file(tenant, file_id) or None, "file", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def create_batch(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    store, runner = api.store, api.runner
    body = validated(CreateBatch, await read_json(request, services.edge.max_body_bytes))
    services.note_ignored("batches", request.url.path, body)
    endpoint, window, file_id = body.endpoint, body.completion_window, body.input_file_id
    content = await read_all(_found(await store.file_content(tenant, file_id), "file", file_id))
    now = int(time.time())
    batch = Batch(
        id=new_id("batch"),
        tenant=tenant,
        input_file_id=file_id,
        endpoint=endpoint,
        completion_window=window,
        created_at=now,
        expires_at=now + WINDOWS[window],
        metadata=body.metadata,
    )
    trace = trace_parent_from(request.headers)
    if trace is not None:
        batch.traceparent, batch.tracestate = trace.traceparent, trace.tracestate
    models = services.planner.models(services.planner.tenant_of(context_of(request)))
    lines, errors = _lines(content, endpoint, _endpoint(runner, endpoint), models)
    batch.request_counts["total"] = len(lines)
    if errors or not lines:
        batch.status = "failed"
        batch.times["failed"] = now
        batch.errors = {
            "object": "list",
            "data": errors[:MAX_ERRORS]
            or [
                {
                    "code": "empty_file",
                    "message": "the input file has no requests",
                    "param": None,
                    "line": None,
                }
            ],
        }
        await store.add_batch(batch, [])
    else:
        batch.status, batch.times["in_progress"] = "in_progress", now
        await store.add_batch(batch, lines)
        await runner.submit(batch)
    await runner.count_batches()
    return JSONResponse(batch.to_api())


def _endpoint(runner: BatchRunner, endpoint: str) -> LineEndpoint:
    runs = runner.endpoints.get(endpoint)
    if runs is None:
        raise InvalidRequest(f"this server runs no batch of {endpoint}", param="endpoint")
    return runs


def _lines(
    content: bytes, endpoint: str, runs: LineEndpoint, models: list[str]
) -> tuple[list[Line], list[dict[str, Any]]]:
    """The input file's requests, and an error per line that is not one (`runs`: what runs
    the lines of `endpoint`, which checks each body; `models`: those the tenant may name; a
    line that names none gets the tenant's default when it runs)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.decode("utf-8", "replace").splitlines(), start=1):
        if not raw.strip():
            continue

        def error(code: str, message: str, param: str | None = None, number: int = number) -> None:
            errors.append({"code": code, "message": message, "param": param, "line": number})

        try:
            request = json.loads(raw)
        except json.JSONDecodeError:
            error("invalid_json_line", "this line is not valid JSON")
            continue
        if not isinstance(request, dict):
            error("invalid_json_line", "each line must be a JSON object")
            continue
        custom_id, body = request.get("custom_id"), request.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            error(
                "missing_required_parameter", "'custom_id' must be a non-empty string", "custom_id"
            )
        elif custom_id in seen:
            error("duplicate_custom_id", f"the custom_id '{custom_id}' appears twice", "custom_id")
        elif request.get("method") != "POST" or request.get("url") != endpoint:
            error(
                "invalid_url", f"each line must be a POST to the batch's endpoint {endpoint}", "url"
            )
        elif not isinstance(body, dict) or ("model" in body and body["model"] not in models):
            served = ", ".join(f"'{name}'" for name in models) or "none"
            error("model_not_found", f"'body.model' must be a served model: {served}", "body.model")
        else:
            try:
                runs.check(body)
            except SluiceError as refused:
                error(
                    "invalid_request",
                    refused.message,
                    f"body.{refused.param}" if refused.param else "body",
                )
            else:
                seen.add(custom_id)
                lines.append(Line(len(lines), custom_id, body))
    return lines, errors


async def list_batches(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("'limit' must be between 1 and 100", param="limit")
    batches, more = await api.store.batches(
        tenant, request.query_params.get("after"), int(raw_limit)
    )
    data = [batch.to_api() for batch in batches]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def get_batch(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    batch_id = request.path_params["id"]
    return JSONResponse(_found(await api.store.batch(tenant, batch_id), "batch", batch_id).to_api())


async def cancel_batch(services: Services, api: BatchServices, request: Request) -> Response:
    tenant = _tenant(services, request)
    batch_id = request.path_params["id"]
    batch = _found(await api.runner.cancel(tenant, batch_id), "batch", batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise InvalidRequest(f"a batch that is {batch.status} cannot be cancelled")
    return JSONResponse(batch.to_api())
