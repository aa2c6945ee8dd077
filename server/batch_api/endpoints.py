"""OpenAI's Batch API's endpoints (its files and batches): each one's method, path, handler and
OpenAPI operation. Each handler is handed the API's `BatchServices` after the services; the
app serves them only where it has a batch store."""

from __future__ import annotations

from server.batch_api.routes import (
    BatchServices,
    cancel_batch,
    create_batch,
    create_file,
    delete_file,
    file_content,
    get_batch,
    get_file,
    list_batches,
    list_files,
)
from server.batch_api.wire import CreateBatch, FileUpload
from server.http.endpoints import Endpoint
from server.http.operations import (
    STR,
    Operation,
    Schema,
    errors,
    get,
    list_of,
    param,
    post,
    reply,
    request,
    with_id,
)

_BATCH_ID, _FILE_ID = "a batch id", "a file id"


def _upload() -> Operation:
    from openai.types import FileObject

    return {
        "summary": "upload a JSONL file of batch requests",
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": request(FileUpload)}},
        },
        "responses": {"200": reply("the file object", Schema(FileObject)), **errors()},
    }


def _list_files() -> Operation:
    from openai.types import FileObject

    return get("the tenant's files", list_of(Schema(FileObject)))


def _file() -> Operation:
    from openai.types import FileObject

    return get("a file", Schema(FileObject))


def _delete_file() -> Operation:
    from openai.types import FileDeleted

    summary = "delete a file"
    return {"summary": summary, "responses": {"200": reply(summary, Schema(FileDeleted))}}


def _file_content() -> Operation:
    summary = "a file's content"
    content = {"application/jsonl": {"schema": STR}}
    return {"summary": summary, "responses": {"200": {"description": summary, "content": content}}}


def _create_batch() -> Operation:
    from openai.types import Batch

    return post("create a batch", request(CreateBatch), Schema(Batch))


def _list_batches() -> Operation:
    from openai.types import Batch

    operation = get("the tenant's batches", list_of(Schema(Batch)))
    operation["parameters"] = [
        param("after", "query", STR, "the batches after this id"),
        param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}),
    ]
    return operation


def _batch() -> Operation:
    from openai.types import Batch

    return get("a batch", Schema(Batch))


def _cancel_batch() -> Operation:
    from openai.types import Batch

    summary = "cancel a batch"
    return {"summary": summary, "responses": {"200": reply(summary, Schema(Batch))}}


ENDPOINTS: tuple[Endpoint[BatchServices], ...] = (
    Endpoint("POST", "/v1/files", create_file, _upload, "batches"),
    Endpoint("GET", "/v1/files", list_files, _list_files, "batches"),
    Endpoint("GET", "/v1/files/{id}", get_file, with_id(_file, _FILE_ID), "batches"),
    Endpoint("DELETE", "/v1/files/{id}", delete_file, with_id(_delete_file, _FILE_ID), "batches"),
    Endpoint(
        "GET",
        "/v1/files/{id}/content",
        file_content,
        with_id(_file_content, _FILE_ID),
        "batches",
    ),
    Endpoint("POST", "/v1/batches", create_batch, _create_batch, "batches"),
    Endpoint("GET", "/v1/batches", list_batches, _list_batches, "batches"),
    Endpoint("GET", "/v1/batches/{id}", get_batch, with_id(_batch, _BATCH_ID), "batches"),
    Endpoint(
        "POST",
        "/v1/batches/{id}/cancel",
        cancel_batch,
        with_id(_cancel_batch, _BATCH_ID),
        "batches",
    ),
)
