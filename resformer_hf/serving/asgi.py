"""The ASGI plumbing every `resformer-serve` request goes through: its body read whole (and replayed to the app),
its headers' content-length made to match the body the app is given, and answers sent as ASGI messages."""

from __future__ import annotations

import json
from collections.abc import Callable


def with_length(headers: list, body: bytes, dropped: tuple[bytes, ...] = (b"content-length",)) -> list:
    """`headers` without those named in `dropped` (lower case), then the content-length of `body`."""
    kept = [(key, value) for key, value in headers if key.lower() not in dropped]
    return [*kept, (b"content-length", str(len(body)).encode())]


async def answer(send: Callable, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def answer_json(send: Callable, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await answer(send, status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 body)


async def read_body(receive: Callable) -> tuple[bytes, list[dict]]:
    """The request's body, and the messages it came in (`replay` hands them to the app unchanged)."""
    chunks, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


def replay(messages: list[dict], receive: Callable) -> Callable:
    """A `receive` that gives `messages` first, then what `receive` gives."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


__all__ = ["answer", "answer_json", "read_body", "replay", "with_length"]
