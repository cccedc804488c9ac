"""Serving a ResFormer with Hugging Face's own OpenAI-compatible server (`transformers serve`).

`transformers serve` loads a model with `getattr(transformers, config.architectures[0]).from_pretrained(...)`
(`transformers/cli/serving/model_manager.py`, the same on 5.19 and 5.24), so a class that is not an attribute of the
`transformers` module cannot be served, with or without `--trust-remote-code`.
`expose_plugin_classes` makes the plugin's classes such attributes, in this process only; the server's own code is
then used unchanged, every option included.

`transformers serve` answers some bad requests with a 500 (or a stream that ends in an error) rather than a 4xx:
`RequestChecks` is an ASGI middleware that answers them with a 400 and a message first.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import transformers

from .modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
)

PLUGIN_CLASSES = (
    ResFormerModel,
    ResFormerForCausalLM,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerForQuestionAnswering,
)

#: The endpoints whose bodies `RequestChecks` reads, and the fields that bound the number of new tokens there.
GENERATION_ENDPOINTS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def expose_plugin_classes() -> None:
    """Make `transformers.ResFormerForCausalLM` (and the other plugin classes) resolve, as the server's model loader
    needs; an existing attribute of that name is left alone."""
    for model_class in PLUGIN_CLASSES:
        if getattr(transformers, model_class.__name__, None) is None:
            setattr(transformers, model_class.__name__, model_class)


class RequestChecks:
    """ASGI middleware in front of the server's app: a generation request whose token bound is not a positive
    integer, whose prompt does not fit the model's context (`max_position_embeddings`), or that asks for a chat
    completion of a model without a chat template is answered 400 with a message saying what to change. Everything
    else (malformed JSON included, which the server answers 422 itself) goes to the app unchanged."""

    def __init__(self, app: Callable[..., Awaitable[None]], model_source: str) -> None:
        self.app = app
        self.model_source = model_source
        self._tokenizer = None
        self._context = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        checked = scope.get("type") == "http" and scope.get("method") == "POST"
        if not checked or scope.get("path") not in GENERATION_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        body, messages = await _read_body(receive)
        problem = await self._problem(scope["path"], body)
        if problem is not None:
            await _answer(send, 400, {"error": {"message": problem, "type": "invalid_request_error"}})
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _problem(self, path: str, raw: bytes) -> str | None:
        try:
            body = json.loads(raw)
        except ValueError:
            return None  # the server's own 422 ("JSON decode error") says where
        if not isinstance(body, dict):
            return None
        for field in GENERATION_ENDPOINTS[path]:
            value = body.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return f"{field} must be a positive integer (the number of tokens to generate), got {value!r}"
        if path == "/v1/responses":
            return None
        import asyncio

        if self._tokenizer is None:
            self._tokenizer, self._context = await asyncio.to_thread(_tokenizer_and_context, self.model_source)
        return self._prompt_problem(path, body)

    def _prompt_problem(self, path: str, body: dict) -> str | None:
        tokenizer = self._tokenizer
        if path == "/v1/chat/completions":
            if not getattr(tokenizer, "chat_template", None):
                return (f"{self.model_source} has no chat template: use /v1/completions with a plain prompt, or add a "
                        "chat_template to its tokenizer_config.json")
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return None  # the server validates the messages itself
            try:
                ids = tokenizer.apply_chat_template(_text_messages(messages), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
            except Exception:  # noqa: BLE001 - a template error is the server's to report
                return None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            ids = tokenizer(prompt)["input_ids"]
        prompt_tokens = len(ids)
        if self._context is None:
            return None
        if prompt_tokens > self._context:
            return (f"the prompt is {prompt_tokens} tokens but the model's context is {self._context} tokens "
                    "(max_position_embeddings): shorten the prompt")
        requested = next((body[f] for f in GENERATION_ENDPOINTS[path] if body.get(f) is not None), None)
        if requested is not None and prompt_tokens + requested > self._context:
            return (f"the prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) exceeds the model's context "
                    f"of {self._context} tokens: lower max_tokens to {self._context - prompt_tokens} or less")
        return None


def _tokenizer_and_context(model_source: str) -> tuple[Any, int | None]:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_source)
    config = AutoConfig.from_pretrained(model_source)
    config = getattr(config, "get_text_config", lambda: config)()
    return tokenizer, getattr(config, "max_position_embeddings", None)


def _text_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages with list-of-parts content collapsed to text, as the server does for a text model."""
    result = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        result.append({**message, "content": content if content is not None else ""})
    return result


async def _read_body(receive: Callable) -> tuple[bytes, list[dict]]:
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


def _replay(messages: list[dict], receive: Callable) -> Callable:
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _answer(send: Callable, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def checked_requests(model_source: str) -> Iterator[None]:
    """While in the block, every app `uvicorn.Config` is given (the server builds one) runs behind `RequestChecks`.

    `transformers serve` builds its app and its `uvicorn.Config` inside one constructor; a `uvicorn.Config` subclass
    is the one public seam between the two, the same on every supported release."""
    import uvicorn

    original = uvicorn.Config

    class CheckedConfig(original):
        def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(RequestChecks(app, model_source), *args, **kwargs)

    uvicorn.Config = CheckedConfig
    try:
        yield
    finally:
        uvicorn.Config = original
