"""Several choices from a server that makes one per request: OpenAI's `n` and lists of prompts in `resformer-serve`.

`transformers serve` generates one choice per request and ignores `n`. A request for P prompts × n choices is sent to
it as P·n requests of one prompt each, all at once (so continuous batching batches them), and their answers are
merged into the one answer OpenAI's API defines: choice i·n + j is prompt i's j-th, and the usage counts each prompt
once and every generated token. Streams are merged as their chunks arrive, each chunk's choice renumbered, the usage
summed into one last chunk. If a part fails, the whole request gets that part's status and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .asgi import answer, answer_json, with_length

App = Callable[..., Awaitable[None]]


def part_bodies(body: dict, prompts: list[Any] | None, n: int) -> list[dict]:
    """The one-choice bodies of a request: n copies per prompt (`prompts` None: a chat, n copies of it)."""
    base = {key: value for key, value in body.items() if key != "n"}
    return [base if prompt is None else {**base, "prompt": prompt}
            for prompt in (prompts if prompts is not None else [None]) for _ in range(n)]


def _part_scope(scope: dict, body: bytes, request_id: str) -> dict:
    """The scope of one part: its own body length, request id (the server keys its requests by it) and request
    state (uvicorn hands every request a `state` dict, where the server keeps the request id)."""
    headers = with_length(scope.get("headers", []), body, dropped=(b"content-length", b"x-request-id"))
    headers.append((b"x-request-id", request_id.encode()))
    return {**scope, "headers": headers, "state": dict(scope.get("state") or {})}


def request_id(scope: dict) -> str:
    """The client's X-Request-ID, or a new one."""
    given = dict((key.lower(), value) for key, value in scope.get("headers", [])).get(b"x-request-id")
    return given.decode("latin-1") if given else str(uuid.uuid4())


async def call_app(app: App, scope: dict, body: bytes, request_id: str, send: Callable, gone: asyncio.Event) -> None:
    """Run `app` on one request with `body` and `request_id`; it sees a disconnect once `gone` is set (its client
    left, or the merged answer no longer needs it)."""
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    await app(_part_scope(scope, body, request_id), receive, send)


async def _watch_client(receive: Callable, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def fan_out(app: App, scope: dict, receive: Callable, send: Callable, parts: list[dict], n: int,
                  stream: bool) -> None:
    """Answer the request whose one-choice `parts` these are (n per prompt), streaming or not."""
    gone = asyncio.Event()
    queue: asyncio.Queue = asyncio.Queue()
    base_id = request_id(scope)

    async def run(index: int, part: dict) -> None:
        async def part_send(message: dict) -> None:
            await queue.put((index, message))

        try:
            await call_app(app, scope, json.dumps(part).encode(), f"{base_id}-{index}", part_send, gone)
        except Exception:  # noqa: BLE001 - the app sent its 500 before raising; that is the part's answer
            pass
        finally:
            await queue.put((index, None))

    watcher = asyncio.create_task(_watch_client(receive, gone))
    tasks = [asyncio.create_task(run(index, part)) for index, part in enumerate(parts)]
    try:
        await (_merge_stream if stream else _merge_json)(queue, len(parts), n, send, base_id)
    finally:
        gone.set()
        watcher.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


class _Part:
    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: list = []
        self.chunks: list[bytes] = []
        self.done = False


async def _next(queue: asyncio.Queue, parts: list[_Part]) -> int:
    """Take one message off the queue into its part; returns the part's index."""
    index, message = await queue.get()
    part = parts[index]
    if message is None:
        part.done = True
        if part.status is None:  # the app raised before answering
            part.status = 500
            part.chunks.append(json.dumps({"error": {"message": "the server failed on this request"}}).encode())
    elif message["type"] == "http.response.start":
        part.status, part.headers = message["status"], list(message.get("headers", []))
    elif message["type"] == "http.response.body":
        part.chunks.append(message.get("body", b""))
    return index


async def _fail_with(queue: asyncio.Queue, parts: list[_Part], failed: _Part, send: Callable) -> None:
    while not failed.done:
        await _next(queue, parts)
    body = b"".join(failed.chunks)
    await answer(send, failed.status, with_length(failed.headers, body), body)


async def _merge_json(queue: asyncio.Queue, count: int, n: int, send: Callable, merged_id: str) -> None:
    parts = [_Part() for _ in range(count)]
    while not all(part.done for part in parts):
        part = parts[await _next(queue, parts)]
        if part.status is not None and part.status != 200:
            await _fail_with(queue, parts, part, send)
            return
    answers = [json.loads(b"".join(part.chunks)) for part in parts]
    merged = {**answers[0], "id": merged_id}
    merged["choices"] = [{**choice, "index": index} for index, reply in enumerate(answers)
                         for choice in reply.get("choices", [])]
    usages = [reply.get("usage") for reply in answers]
    if all(usages):
        merged["usage"] = _total_usage(usages, n)
    await answer_json(send, 200, merged)


def _total_usage(usages: list[dict], n: int) -> dict:
    """Each prompt's tokens once (n parts share a prompt), every part's generated tokens."""
    prompt = sum(usage.get("prompt_tokens", 0) for index, usage in enumerate(usages) if index % n == 0)
    completion = sum(usage.get("completion_tokens", 0) for usage in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merge_stream(queue: asyncio.Queue, count: int, n: int, send: Callable, merged_id: str) -> None:
    parts = [_Part() for _ in range(count)]
    sent = [0] * count  # chunks of each part already forwarded
    pending = [b""] * count  # an event cut between two chunks
    usages: list[dict | None] = [None] * count
    last: dict = {}
    done_marker = False
    started = False
    while not all(part.done for part in parts):
        index = await _next(queue, parts)
        part = parts[index]
        if part.status is not None and part.status != 200:
            if started:  # cannot happen: every part's start comes before anything is sent
                raise RuntimeError("a part of a merged stream failed after the stream started")
            await _fail_with(queue, parts, part, send)
            return
        if not started and all(p.status == 200 for p in parts):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            started = True
        if not started:
            continue
        for position, chunks in enumerate(p.chunks for p in parts):
            text = pending[position] + b"".join(chunks[sent[position]:])
            sent[position] = len(chunks)
            *events, pending[position] = text.split(b"\n\n")
            out = []
            for event in events:
                if event.strip() == b"data: [DONE]":
                    done_marker = True
                    continue
                chunk, usage = _renumbered(event, position)
                if usage is not None:
                    usages[position] = usage
                if chunk is not None and "id" in chunk:
                    chunk["id"] = merged_id
                if chunk is not None:
                    last = chunk
                    out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    tail = b""
    if all(usages) and last:
        final = {key: last[key] for key in ("id", "object", "created", "model") if key in last}
        tail += b"data: " + json.dumps({**final, "choices": [], "usage": _total_usage(usages, n)}).encode() + b"\n\n"
    if done_marker:
        tail += b"data: [DONE]\n\n"
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _renumbered(event: bytes, index: int) -> tuple[dict | None, dict | None]:
    """(the event's chunk with its choices numbered `index` and without usage, or None if nothing is left; its
    usage). An event that is not JSON is passed on as `{"error": text}`."""
    text = event.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None, None
    try:
        chunk = json.loads(text[5:].strip())
    except ValueError:
        return {"error": text[5:].strip()}, None
    if not isinstance(chunk, dict):
        return None, None
    usage = chunk.pop("usage", None)
    choices = chunk.get("choices")
    if isinstance(choices, list):
        chunk["choices"] = [{**choice, "index": index} for choice in choices if isinstance(choice, dict)]
        if not chunk["choices"] and usage is not None:
            return None, usage
    return chunk, usage


__all__ = ["call_app", "fan_out", "part_bodies"]
