"""OpenAI's error shape on every error `resformer-serve` sends, whoever made it.

OpenAI answers an error with `{"error": {"message", "type", "param", "code"}}`, and a client's mistake (an unknown or
malformed field, a body that is not JSON) with a 400. `transformers serve` (5.19 to 5.24) answers in FastAPI's
shapes instead: `{"detail": "..."}` from its handlers (422 for an unexpected field, 400 for a model it does not
serve), `{"detail": [...]}` (FastAPI's 422 for a body that is not JSON or not an object), `{"detail": "Not Found"}`
(404, 405), `{"error": "..."}` (503 once the batching worker died, and an error event inside a stream) and a plain-text
500. `openai_errors` rewrites each on its way out: the message kept (made to say what to do where the server's does
not), 422 made 400, a model the server does not serve 404 `model_not_found`, as OpenAI answers them.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import Any

from .asgi import with_length

#: HF's handlers' prefixes for an unexpected field and for a model other than the served one (5.19 to 5.24).
UNEXPECTED_FIELDS = "Unexpected fields in the request: "
PINNED_MODEL = "Server is pinned to "
SSE_ERROR = b'data: {"error": '


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: `kind` is its `type` (`invalid_request_error` for the client's mistakes,
    `server_error` for the server's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _validation_message(entries: list) -> str:
    """FastAPI's 422 list (a body that is not JSON, or not an object) as one sentence."""
    parts = []
    for entry in entries if isinstance(entries, list) else []:
        entry = entry if isinstance(entry, dict) else {}
        if entry.get("type") == "json_invalid":
            where, why = (entry.get("loc") or [None, None])[-1], (entry.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON (JSON decode error at character {where}: {why})")
        else:
            parts.append(f"{'.'.join(str(part) for part in entry.get('loc', []))}: {entry.get('msg', entry)}")
    sentence = "; ".join(parts or ["the request body could not be read"])
    return f"{sentence}: send one JSON object of the endpoint's fields"


def _unexpected_fields_message(detail: str) -> tuple[str, str | None]:
    try:
        names = sorted(ast.literal_eval(detail[len(UNEXPECTED_FIELDS):]))
    except (ValueError, SyntaxError, TypeError):
        return detail, None
    return (f"Unrecognized request argument{'s' if len(names) > 1 else ''} supplied: {', '.join(names)}. This "
            "endpoint takes the fields of OpenAI's API for it: drop the others"), names[0] if names else None


def openai_error(status: int, body: bytes, method: str, path: str) -> tuple[int, dict]:
    """The status and OpenAI error body for an error answer `body` of `status` to `method path`."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = body.decode("utf-8", errors="replace").strip()
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:  # OpenAI's shape already: completed, status kept
        return status, {"error": {**error_body("")["error"], **error}}
    detail = payload.get("detail", error) if isinstance(payload, dict) else payload
    kind = "server_error" if status >= 500 else "invalid_request_error"
    param = code = None
    if isinstance(detail, list):
        message = _validation_message(detail)
    elif not isinstance(detail, str) or not detail:
        message = "the server failed on this request (its log says why)" if status >= 500 else str(payload)
    elif detail.startswith(UNEXPECTED_FIELDS):
        message, param = _unexpected_fields_message(detail)
    elif detail.startswith(PINNED_MODEL):
        status, param, code = 404, "model", "model_not_found"
        message = f"{detail} This server serves one model: send its id (GET /v1/models lists it) as model"
    elif status in (404, 405):
        message = (f"{detail}: {method} {path} is not an endpoint of this server (see GET /v1/models, POST "
                   "/v1/completions, /v1/chat/completions, /v1/responses)")
    elif status >= 500 and detail == "Internal Server Error":
        message = "the server failed on this request (its log says why)"
    else:
        message = detail
    return (400 if status == 422 else status), error_body(message, kind, param, code)


def _sse_errors(body: bytes) -> bytes:
    """A stream's chunk with each `data: {"error": "..."}` event in OpenAI's shape (HF writes the message
    unescaped, so it is read up to the event's closing `"}`)."""
    lines = body.split(b"\n")
    for index, line in enumerate(lines):
        if line.startswith(SSE_ERROR):
            text = line[len(SSE_ERROR):].decode("utf-8", errors="replace").strip()
            try:
                message = json.loads(text[:-1]) if text.endswith("}") else text
            except ValueError:
                message = text[1:-2] if text.endswith('"}') else text
            if not isinstance(message, dict):
                lines[index] = b"data: " + json.dumps(error_body(str(message), "server_error")).encode()
    return b"\n".join(lines)


def openai_errors(scope: dict, send: Callable) -> Callable:
    """`send` for one request of `scope`, answering every error in OpenAI's shape (see the module docstring): an
    error answer is held until its body is complete, then rewritten; a stream's error events are rewritten as sent."""
    held: dict[str, Any] = {}

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = dict((key.lower(), value) for key, value in message.get("headers", []))
            held.update(stream=headers.get(b"content-type", b"").startswith(b"text/event-stream"))
            if message["status"] >= 400:
                held.update(start=message, chunks=[])
                return
        elif message["type"] == "http.response.body" and "start" in held:
            held["chunks"].append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held.pop("start")
            status, payload = openai_error(start["status"], b"".join(held["chunks"]), scope.get("method", ""),
                                           scope.get("path", ""))
            body = json.dumps(payload).encode()
            headers = with_length(start.get("headers", []), body, (b"content-length", b"content-type"))
            await send({**start, "status": status, "headers": [(b"content-type", b"application/json"), *headers]})
            await send({"type": "http.response.body", "body": body})
            return
        elif message["type"] == "http.response.body" and held.get("stream") and SSE_ERROR in message.get("body", b""):
            message = {**message, "body": _sse_errors(message["body"])}
        await send(message)

    return sending


__all__ = ["error_body", "openai_error", "openai_errors"]
