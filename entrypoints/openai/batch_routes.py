"""OpenAI's Files and Batch APIs: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content,
POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel. The jobs: batch_jobs.py; their
state on disk: batch_store.py."""
from __future__ import annotations

from email.parser import BytesParser
from email.policy import HTTP
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import errors as E
from .batch_jobs import BatchManager
from .batch_lines import ENDPOINTS
from .batch_store import BatchStore
from .http import read_json

FILE_PURPOSES = ("batch",)


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[Optional[str], bytes]]:
    """A multipart/form-data body as {field: (filename, bytes)} (the stdlib's MIME parser)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise E.bad_request("Upload the file as multipart/form-data (fields `file` and `purpose`).", "file",
                            "invalid_value")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") +
                                                  b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise E.bad_request("The multipart/form-data body could not be parsed.", "file", "invalid_value")
    fields: dict[str, tuple[Optional[str], bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            payload = part.get_payload(decode=True)
            fields[str(name)] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def _page(items: list[dict[str, Any]], after: Optional[str], limit: int) -> dict[str, Any]:
    """A cursor page as the SDK's SyncCursorPage reads it (`after`: the last id of the previous page)."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def _limit(value: Optional[str], default: int = 20, most: int = 10000) -> int:
    try:
        limit = default if value is None else int(value)
    except ValueError:
        limit = -1
    if not 1 <= limit <= most:
        raise E.bad_request(f"limit must be an integer in [1, {most}], got {value!r}.", "limit", "invalid_value")
    return limit


def add_batch_routes(app: FastAPI, serving: Any, batch_dir: Optional[str]) -> BatchManager:
    """The routes; the jobs start (and unfinished ones resume) once the engine is up."""
    store = BatchStore(batch_dir)
    manager = BatchManager(store, app)
    serving.on_started.append(manager.start)
    serving.on_stopping.append(manager.stop)
    app.state.batches = manager

    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        fields = parse_multipart(request.headers.get("content-type", ""), await request.body())
        if "file" not in fields:
            raise E.bad_request("Missing required parameter: 'file'.", "file", "missing_required_parameter")
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if not purpose:
            raise E.bad_request("Missing required parameter: 'purpose'.", "purpose", "missing_required_parameter")
        if purpose not in FILE_PURPOSES:
            raise E.bad_request(f"purpose must be one of {', '.join(FILE_PURPOSES)} on this server, got "
                                f"{purpose!r}.", "purpose", "invalid_value")
        filename, content = fields["file"]
        return JSONResponse(store.add_file(content, filename or "upload.jsonl", purpose))

    @app.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        q = request.query_params
        return JSONResponse(_page(store.list_files(q.get("purpose")), q.get("after"),
                                  _limit(q.get("limit"), 10000)))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        return JSONResponse(store.get_file(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(store.read_content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(store.delete_file(file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise E.bad_request("The body must be a JSON object.", None, "invalid_value")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise E.bad_request(f"Missing required parameter: {name!r}.", name, "missing_required_parameter")
        if body["endpoint"] not in ENDPOINTS:
            raise E.bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body['endpoint']!r}.",
                                "endpoint", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise E.bad_request("metadata must be an object.", "metadata", "invalid_value")
        try:
            batch = manager.create(body["input_file_id"], body["endpoint"], body["completion_window"], metadata)
        except E.APIError as err:
            if err.status == 404:      # the file: named as the parameter input_file_id
                raise E.APIError(404, err.message, err.type, "input_file_id", err.code) from None
            raise
        return JSONResponse(batch)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        q = request.query_params
        batches = [manager.live.get(r["batch"]["id"], r)["batch"] for r in store.list_records()]
        return JSONResponse(_page(batches, q.get("after"), _limit(q.get("limit"))))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(manager.record(batch_id)["batch"])

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(manager.cancel(batch_id))

    return manager
