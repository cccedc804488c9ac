"""Serving a ResFormer with Hugging Face's own OpenAI-compatible server (`transformers serve`).

`transformers serve` loads a model with `getattr(transformers, config.architectures[0]).from_pretrained(...)`
(`transformers/cli/serving/model_manager.py`, the same on 5.19 and 5.24), so a class that is not an attribute of the
`transformers` module cannot be served, with or without `--trust-remote-code`.
`expose_plugin_classes` makes the plugin's classes such attributes, in this process only; the server's own code is
then used unchanged, every option included.

`checked_requests` adds what the server lacks, through its seams: eight classes it looks up when it is built
(`uvicorn.Config` and `uvicorn.Server`, its generation state, its three request handlers and two generation
managers), each replaced by a subclass while the server runs (the one table in `checked_requests`). They add:

- `RequestChecks`, an ASGI middleware: every error answer in OpenAI's shape, the server's too (`openai_errors`); a
  request the model cannot run or that the server would misread gets a 400 with a message (`checks`), checked off
  the event loop (a 5 MB prompt does not stall `/health`); `n` > 1 and lists of prompts are answered with every
  choice (`fanout`); each request is given an id of its own, the key the server's engine files it under (two
  requests with one client `X-Request-ID` are both answered), and the client's `X-Request-ID` is echoed on its
  answer;
- OpenAI's sampling semantics, with and without continuous batching (`sampling`);
- OpenAI's `stop`, `logprobs` / `top_logprobs` and `echo`, with and without continuous batching (`stops`,
  `logprobs`);
- `TokenIdsCompletionHandler`: token-id prompts, which the OpenAI completions API allows and the server refuses;
- a watchdog: if the continuous-batching worker dies (the server's `/health` says `cb_worker_dead`), the server
  stops and `resformer-serve` exits with status 1, so a supervisor restarts it, instead of answering 503 forever;
- the continuous-batching thread stopped when the server stops (the server leaves it running, and the process with
  it, after a SIGTERM too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import transformers

from ..remote_code.modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
)
from .asgi import answer_json, read_body, replay, with_length
from .checks import GENERATION_ENDPOINTS, ModelFacts, check_request, load_model_facts
from .fanout import fan_out, part_bodies
from .logprobs import outputs_handler, outputs_manager
from .openai_errors import error_body, openai_errors
from .sampling import per_request_manager, sampling_handler, seeded_manager

PLUGIN_CLASSES = (
    ResFormerModel,
    ResFormerForCausalLM,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerForQuestionAnswering,
)
#: Seconds between two looks at the server's `/health` for a dead continuous-batching worker.
WATCH_INTERVAL_S = 1.0

logger = logging.getLogger(__name__)


def expose_plugin_classes() -> None:
    """Make `transformers.ResFormerForCausalLM` (and the other plugin classes) resolve, as the server's model loader
    needs; an existing attribute of that name is left alone."""
    for model_class in PLUGIN_CLASSES:
        if getattr(transformers, model_class.__name__, None) is None:
            setattr(transformers, model_class.__name__, model_class)


@dataclass
class ServerState:
    """What `checked_requests` learns about the server it wraps: the uvicorn server, the server's generation state
    (its continuous-batching worker), and whether it was stopped because that worker died."""

    server: Any = None
    generation_state: Any = None
    worker_died: str | None = None
    answered: int = 0  #: generation requests answered (what `resformer-serve` says it did when stopped)


class RequestChecks:
    """ASGI middleware in front of the server's app (see the module docstring). Malformed JSON goes to the app
    unchanged (it answers FastAPI's 422, which `openai_errors` makes OpenAI's 400)."""

    def __init__(self, app: Callable[..., Awaitable[None]], model_source: str,
                 state: ServerState | None = None, batching: bool = False) -> None:
        self.app = app
        self.model_source = model_source
        self.state = state or ServerState()
        self.batching = batching  #: the server runs with --continuous-batching
        self._facts: ModelFacts | None = None
        self._facts_lock = asyncio.Lock()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") == "lifespan":
            await self._with_watchdog(scope, receive, send)
            return
        if scope.get("type") == "http":  # every error in OpenAI's shape, the server's own and its app's
            send = openai_errors(scope, send)
        checked = scope.get("type") == "http" and scope.get("method") == "POST"
        if not checked or scope.get("path") not in GENERATION_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        await self._checked(scope, receive, send)
        self.state.answered += 1

    async def _checked(self, scope: dict, receive: Callable, send: Callable) -> None:
        """A generation request: checked, fanned out or passed on (see the module docstring)."""
        scope, send = _own_request_id(scope, send)
        raw, messages = await read_body(receive)
        facts = await self._model_facts()
        plan = await asyncio.to_thread(check_request, scope["path"], raw, facts, self.batching)
        if isinstance(plan, str):
            await answer_json(send, 400, error_body(plan))
            return
        if plan is None:  # not a JSON object: the app's own answer
            await self.app(scope, replay(messages, receive), send)
            return
        if plan.choices > 1:
            prompts = plan.prompts if scope["path"] == "/v1/completions" else None
            await fan_out(self.app, scope, receive, send, part_bodies(plan.body, prompts, plan.n), plan.n,
                          bool(plan.body.get("stream")))
            return
        body = json.dumps(plan.body).encode()
        scope = {**scope, "headers": with_length(scope.get("headers", []), body)}
        await self.app(scope, replay([{"type": "http.request", "body": body}], receive), send)

    async def _model_facts(self) -> ModelFacts:
        async with self._facts_lock:
            if self._facts is None:
                self._facts = await asyncio.to_thread(load_model_facts, self.model_source)
        return self._facts

    async def _with_watchdog(self, scope: dict, receive: Callable, send: Callable) -> None:
        watchdog = asyncio.create_task(self._watch_worker())
        try:
            await self.app(scope, receive, send)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog

    async def _watch_worker(self) -> None:
        """Every `WATCH_INTERVAL_S`, ask the server's generation state what its `/health` reports; once the
        continuous-batching worker is dead, record it and stop the server (in-flight requests have failed already)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            generation = self.state.generation_state
            if generation is not None and not generation.is_cb_alive():
                self.state.worker_died = "cb_worker_dead"
                logger.error("resformer-serve: the continuous-batching worker died (its error is logged above); "
                             "stopping the server so that it can be restarted")
                server = self.state.server
                if server is not None:
                    server.config.timeout_graceful_shutdown = 10
                    server.should_exit = True
                return


def token_ids_inputs(ids: list[int], use_cb: bool, device: Any):
    """What the completion handler makes of a text prompt, for token ids: a list for continuous batching, a batch of
    one on the model's device for `generate()`."""
    from transformers import BatchEncoding

    if use_cb:
        return BatchEncoding({"input_ids": list(ids), "attention_mask": [1] * len(ids)})
    return BatchEncoding({"input_ids": [list(ids)], "attention_mask": [[1] * len(ids)]}, tensor_type="pt").to(device)


def token_ids_completion_handler(base: type) -> type:
    """`base` (the server's `CompletionHandler`) serving a prompt of token ids as it serves a text prompt's."""

    class TokenIdsCompletionHandler(base):
        async def handle_request(self, body: dict, request_id: str):
            prompt = body.get("prompt")
            if not (isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt)):
                return await super().handle_request(body, request_id)
            # The steps of `CompletionHandler.handle_request` (5.19 to 5.24), with the ids for the tokenizer's output
            self._validate_request(body)
            model_id, model, processor = self._resolve_model(body)
            modality = self.model_manager.get_model_modality(model, processor=processor)
            use_cb = self.generation_state.use_continuous_batching(model, modality)
            gen_manager = self.generation_state.get_manager(model_id, use_cb=use_cb)
            inputs = token_ids_inputs(prompt, use_cb, model.device)
            gen_config = self._build_generation_config(body, model.generation_config, use_cb=use_cb)
            if use_cb:
                gen_manager.init_cb(model, gen_config)
            arguments = (request_id, model, processor, model_id, inputs, gen_config, gen_manager, body.get("suffix"))
            if body.get("stream"):
                return self._streaming(*arguments)
            return await self._non_streaming(*arguments)

    return TokenIdsCompletionHandler


def _own_request_id(scope: dict, send: Callable) -> tuple[dict, Callable]:
    """`scope` with an `X-Request-ID` of the server's own (the key its engine files the request under), and `send`
    answering with the client's `X-Request-ID`, or that id if the client gave none."""
    own = str(uuid.uuid4()).encode()
    headers = [(key, value) for key, value in scope.get("headers", []) if key.lower() != b"x-request-id"]
    echoed = next((value for key, value in scope.get("headers", []) if key.lower() == b"x-request-id"), own)

    async def echoing(message: dict) -> None:
        if message["type"] == "http.response.start":
            kept = [(key, value) for key, value in message.get("headers", []) if key.lower() != b"x-request-id"]
            message = {**message, "headers": [*kept, (b"x-request-id", echoed)]}
        await send(message)

    return {**scope, "headers": [*headers, (b"x-request-id", own)]}, echoing


def _checking_config(base: type, checks: Callable[[Any], Any]) -> type:
    """`base` (`uvicorn.Config`) serving `checks(app)` in front of the app it is given."""

    class CheckedConfig(base):
        def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(checks(app), *args, **kwargs)

    return CheckedConfig


def _recording(base: type, state: ServerState, attribute: str) -> type:
    """`base` setting `state.<attribute>` to each instance it makes: the server builds them inside one constructor and
    keeps them to itself, and the watchdog and the shutdown need them."""

    class Recorded(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setattr(state, attribute, self)

    Recorded.__name__ = Recorded.__qualname__ = f"Recorded{base.__name__}"
    return Recorded


@contextlib.contextmanager
def _replaced(replacements: list[tuple[Any, str, type]]) -> Iterator[None]:
    """Each (module, name, replacement): `module.name` is `replacement` while in the block, the original after."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in replacements]
    for module, name, replacement in replacements:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


@contextlib.contextmanager
def checked_requests(model_source: str, batching: bool = False) -> Iterator[ServerState]:
    """While in the block, the server `transformers serve` builds runs behind `RequestChecks`, serves token-id
    prompts, samples as OpenAI's API defines (`sampling`), and is stopped if its continuous-batching worker
    dies (the yielded state says so afterwards). `batching`: the server is started with --continuous-batching.

    `transformers serve` builds its app, its `uvicorn.Config` and `uvicorn.Server`, its generation state and its
    handlers inside one constructor, looking each class up in its module; a subclass put there is the one seam
    between them, the same on every supported release. Every class replaced is in the one table below."""
    import uvicorn
    from transformers.cli.serving import chat_completion, completion, response, utils

    state = ServerState()

    def checked(app: Any) -> RequestChecks:
        return RequestChecks(app, model_source, state, batching)

    token_ids_handler = token_ids_completion_handler(completion.CompletionHandler)
    replacements = [
        (uvicorn, "Config", _checking_config(uvicorn.Config, checked)),
        (uvicorn, "Server", _recording(uvicorn.Server, state, "server")),
        (utils, "GenerationState", _recording(utils.GenerationState, state, "generation_state")),
        (completion, "CompletionHandler", outputs_handler(sampling_handler(token_ids_handler), "completion")),
        (chat_completion, "ChatCompletionHandler",
         outputs_handler(sampling_handler(chat_completion.ChatCompletionHandler), "chat")),
        (response, "ResponseHandler", sampling_handler(response.ResponseHandler)),
        (utils, "GenerateManager", seeded_manager(outputs_manager(utils.GenerateManager))),
        (utils, "CBGenerateManager", per_request_manager(outputs_manager(utils.CBGenerateManager))),
    ]
    try:
        with _replaced(replacements):
            yield state
    finally:
        if state.generation_state is not None:
            # The server never stops its continuous-batching thread, which is not a daemon: without this the process
            # outlives its server (after SIGTERM too) until it is killed.
            state.generation_state.shutdown()
