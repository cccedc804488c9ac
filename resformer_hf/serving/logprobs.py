"""Log-probabilities, `echo` and `stop` in `resformer-serve`'s answers, with and without continuous batching.

`transformers serve` (5.19 to 5.24) drops `logprobs`, `top_logprobs` and `echo` with a warning in its log and
answers 200 without them, so a client that asks for log-probabilities (lm-eval's loglikelihood requests: `echo`,
`logprobs` 1, `max_tokens` 1) gets text instead. Here, for a request that asks for them (not streamed: a streamed one
is refused by `logprobs_problem`), once its tokens are generated the model scores the prompt and the generated tokens
in one forward pass, and the answer carries them as OpenAI's API defines: for /v1/completions `logprobs`
(`tokens`, `token_logprobs`, `top_logprobs` with the `logprobs` most likely tokens and the chosen one,
`text_offset`), the prompt's tokens first with `echo` (the first one's log-probability null), and `echo` puts the
prompt before the text; for chat `logprobs.content`, one entry per generated token with its `top_logprobs`. They
are the model's own log-softmax in float32, before any temperature or filter (as vLLM's by default). `echo` with
`max_tokens` 0 is the legacy API's scoring request: the prompt and, with `logprobs`, its log-probabilities, and no
token generated (`finish_reason` "length"); without `echo`, `max_tokens` 0 is a 400 that says to add it. The
forward pass runs on the server's inference thread, or with continuous batching beside the engine, one at a time with
its steps (a lock around the model's forward). `stop` is applied to every answer (`stops`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .stops import StopWatch, cut_at_stop, stop_strings, stopping_queue

#: OpenAI's bounds: /v1/completions `logprobs` 0 to 5, chat `top_logprobs` 0 to 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def logprobs_problem(path: str, body: dict) -> str | None:
    """The message of a 400 for `logprobs`, `top_logprobs` or `echo` outside what OpenAI's API takes, or asked for
    in a stream; None otherwise."""
    logprobs, echo, top = body.get("logprobs"), body.get("echo"), body.get("top_logprobs")
    if path == "/v1/completions":
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
            return (f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} (how many of the most likely "
                    f"tokens to list at each position), got {logprobs!r}")
        if echo is not None and not isinstance(echo, bool):
            return f"echo must be true or false (whether the answer repeats the prompt), got {echo!r}"
        asked = [name for name in ("logprobs", "echo") if body.get(name) not in (None, False)]
        if _is_int(body.get("max_tokens")) and body["max_tokens"] == 0 and echo is not True:
            if logprobs is not None:
                return ("logprobs with max_tokens 0 and no echo asks for the log-probabilities of no token: add "
                        "echo: true to score the prompt (its tokens' log-probabilities, nothing generated), or ask "
                        "for max_tokens of 1 or more")
            return ("max_tokens 0 generates no token, so the answer would be empty: add echo: true to get the prompt "
                    "back (with logprobs, its tokens' log-probabilities), or ask for max_tokens of 1 or more")
    elif path == "/v1/chat/completions":
        if logprobs is not None and not isinstance(logprobs, bool):
            return f"logprobs must be true or false (whether to return each token's log-probability), got {logprobs!r}"
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            return f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}"
        if top is not None and logprobs is not True:
            return "top_logprobs needs logprobs: true"
        asked = ["logprobs"] if logprobs else []
    else:
        return None
    if asked and body.get("stream"):
        names = " and ".join(asked)
        return (f"{names} cannot be streamed by this server: send the request with stream false to get {names}, "
                f"or stream it without {names}")
    return None


@dataclass
class RequestOutputs:
    """What a request asks for beyond the generated text, and what the generation manager found for it."""

    kind: str  #: "completion" or "chat"
    body: dict
    top: int | None = None  #: the most likely tokens to list per position; None: no log-probabilities
    prompt_ids: list[int] = field(default_factory=list)
    generated_ids: list[int] = field(default_factory=list)
    scored: list[tuple[float, list[tuple[int, float]]]] | None = None  #: per token after the first: (logprob, top)
    stopped: bool = False
    #: `echo` with `max_tokens` 0, OpenAI's legacy scoring: the prompt and its log-probabilities, nothing generated
    score_only: bool = False

    @classmethod
    def of(cls, kind: str, body: dict) -> RequestOutputs:
        if kind == "completion":
            top = body.get("logprobs")
        else:
            top = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
        score_only = kind == "completion" and body.get("echo") is True and body.get("max_tokens") == 0
        return cls(kind, body, top, score_only=score_only)


#: The request being handled (each is handled in a task of its own; its manager calls run in that task).
_outputs: contextvars.ContextVar[RequestOutputs | None] = contextvars.ContextVar("resformer_serve_outputs",
                                                                                  default=None)


def score(model: Any, ids: list[int], start: int, top: int, lock: Any = None) -> list[tuple[float, list]]:
    """For each of `ids[start:]` (start ≥ 1): its log-probability given the tokens before it, and the `top` most
    likely tokens there with theirs: the model's log-softmax over one forward pass, in float32."""
    with lock or _NO_LOCK, torch.no_grad():
        inputs = torch.tensor([ids[:-1]], device=model.device)
        logits = model(input_ids=inputs, use_cache=False).logits[0, start - 1:].float()
    log_probs = logits.log_softmax(-1)
    targets = torch.tensor(ids[start:], device=log_probs.device)
    chosen = log_probs.gather(-1, targets[:, None])[:, 0].tolist()
    if top:
        values, indices = log_probs.topk(top, dim=-1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen, tops))


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_LOCK = _NoLock()


def completion_logprobs(tokenizer: Any, outputs: RequestOutputs, echo: bool, text_start: int) -> dict:
    """OpenAI's /v1/completions `logprobs` object: the prompt's tokens first when `echo` (its first token's
    log-probability null), then the generated ones; `top_logprobs` holds the `logprobs` most likely tokens and the
    chosen one."""
    prompt, generated, scored = outputs.prompt_ids, outputs.generated_ids, outputs.scored
    ids = (prompt if echo else []) + generated
    entries: list[tuple[float, list] | None] = ([None] + scored if echo else scored[len(prompt) - 1:])
    tokens = [tokenizer.decode([token]) for token in ids]
    token_logprobs, top_logprobs = [], []
    for text, entry in zip(tokens, entries):
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        logprob, top = entry
        token_logprobs.append(logprob)
        listed: dict[str, float] = {}
        for candidate, value in top:  # tokens that decode alike (bytes of one character) keep the likeliest's
            listed.setdefault(tokenizer.decode([candidate]), value)
        listed.setdefault(text, logprob)
        top_logprobs.append(listed)
    offsets, position = [], 0 if echo else text_start
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, outputs: RequestOutputs) -> dict:
    """OpenAI's chat `logprobs` object: one entry per generated token, with its `top_logprobs` most likely ones."""

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, (logprob, top) in zip(outputs.generated_ids, outputs.scored[len(outputs.prompt_ids) - 1:]):
        content.append({**entry(token, logprob), "top_logprobs": [entry(*candidate) for candidate in top]})
    return {"content": content, "refusal": None}


def outputs_handler(base: type, kind: str) -> type:
    """`base` (the server's completions or chat handler) recording what each request asks for beyond text, and
    answering with it: log-probabilities, `echo`, and `finish_reason` "stop" where a stop string ended it."""

    class OutputsHandler(base):
        def _build_generation_config(self, body: dict, model_generation_config: Any, use_cb: bool = False) -> Any:
            outputs = RequestOutputs.of(kind, body)
            _outputs.set(outputs)
            if outputs.score_only:  # a valid config (the first request's sets up the batching engine); none runs
                body = {**body, "max_tokens": 1}
            return super()._build_generation_config(body, model_generation_config, use_cb=use_cb)

        async def _non_streaming(self, request_id: str, model: Any, processor: Any, *args: Any, **kwargs: Any) -> Any:
            response = await super()._non_streaming(request_id, model, processor, *args, **kwargs)
            outputs = _outputs.get()
            body = outputs.body if outputs is not None else {}
            if outputs is None or not (outputs.top is not None or outputs.stopped or body.get("echo")):
                return response
            from fastapi.responses import JSONResponse

            tokenizer = getattr(processor, "tokenizer", processor)
            answer = json.loads(response.body)
            choice = answer["choices"][0]
            if outputs.stopped:
                choice["finish_reason"] = "stop"
            if outputs.score_only:  # as OpenAI's legacy API: no token, for want of room
                choice["finish_reason"] = "length"
            if kind == "completion":
                prompt = body.get("prompt")
                prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(outputs.prompt_ids)
                echo = bool(body.get("echo"))
                if outputs.top is not None:
                    choice["logprobs"] = completion_logprobs(tokenizer, outputs, echo, len(prompt_text))
                if echo:
                    choice["text"] = prompt_text + choice["text"]
            elif outputs.top is not None:
                choice["logprobs"] = chat_logprobs(tokenizer, outputs)
            return JSONResponse(answer, media_type="application/json")

    OutputsHandler.__name__ = OutputsHandler.__qualname__ = f"Outputs{base.__name__}"
    return OutputsHandler


def outputs_manager(base: type) -> type:
    """`base` (the server's `GenerateManager` or `CBGenerateManager`) applying `stop` (`stops`) and scoring the
    tokens of a request that asks for log-probabilities."""

    class OutputsManager(base):
        def init_cb(self, model: Any, gen_config: Any) -> None:
            if getattr(self, "_cb", None) is None:
                _forward_lock(model)  # before the engine starts: every step of it takes the lock
            super().init_cb(model, gen_config)

        def generate_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any, request_id: str,
                               *args: Any, **kwargs: Any) -> Any:
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id, *args,
                                                         **kwargs)
            stops = stop_strings(gen_config.stop_strings)
            return (stopping_queue(queue, streamer, stops) if stops else queue), streamer

        async def generate_non_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any,
                                         request_id: str) -> Any:
            stops = stop_strings(gen_config.stop_strings)
            batching = hasattr(self, "_cb")
            tokenizer = getattr(processor, "tokenizer", processor)
            outputs = _outputs.get()
            if outputs is not None and outputs.score_only:
                prompt = inputs["input_ids"]
                text, input_len, ids = "", len(prompt if batching else prompt[0]), []
                stops = []
            elif stops and batching:
                ids = await self._until_stop(tokenizer, inputs, gen_config, request_id, stops)
                text, input_len = tokenizer.decode(ids, skip_special_tokens=True), len(inputs["input_ids"])
            else:
                text, input_len, ids = await super().generate_non_streaming(model, processor, inputs, gen_config,
                                                                            request_id)
            if stops:
                cut = cut_at_stop(tokenizer, text, [int(token) for token in ids], stops)
                if cut is not None:
                    text, kept = cut
                    ids = ids[:kept]
                    if outputs is not None:
                        outputs.stopped = True
            if outputs is not None:  # `echo` of a token-id prompt decodes these
                prompt = inputs["input_ids"]
                outputs.prompt_ids = [int(token) for token in (prompt if batching else prompt[0])]
                outputs.generated_ids = [int(token) for token in ids]
            if outputs is not None and outputs.top is not None:
                all_ids = outputs.prompt_ids + outputs.generated_ids
                if len(all_ids) < 2:  # one prompt token and nothing generated: no token has a log-probability
                    outputs.scored = []
                elif batching:
                    lock = _forward_lock(model)
                    outputs.scored = await asyncio.to_thread(score, model, all_ids, 1, outputs.top, lock)
                else:
                    outputs.scored = await self.async_submit(score, model, all_ids, 1, outputs.top)
            return text, input_len, ids

        async def _until_stop(self, tokenizer: Any, inputs: dict, gen_config: Any, request_id: str,
                              stops: list[str]) -> list[int]:
            """The engine's tokens for the request, generated as a stream and cancelled once a stop string is
            complete (the engine itself would generate up to `max_tokens`)."""
            cb = self._cb
            self._check_alive(request_id)
            future = asyncio.get_running_loop().create_future()
            watch = StopWatch(tokenizer, stops)

            def on_output(output: Any) -> None:
                if future.done():
                    return
                if output.error is not None:
                    future.set_exception(RuntimeError(f"CB generation failed for {request_id}: {output.error}"))
                    return
                kept = watch.feed(output.generated_tokens)
                if kept is not None:
                    cb.cancel_request(request_id)
                    future.set_result(list(output.generated_tokens[:kept]))
                elif output.is_finished():
                    future.set_result(list(output.generated_tokens))

            cb.register_result_handler(request_id, on_output)
            cb.add_request(list(inputs["input_ids"]), request_id=request_id, streaming=True,
                           max_new_tokens=gen_config.max_new_tokens, eos_token_id=gen_config.eos_token_id)
            return await future

    OutputsManager.__name__ = OutputsManager.__qualname__ = f"Outputs{base.__name__}"
    return OutputsManager


def _forward_lock(model: Any) -> threading.Lock:
    """A lock held around each of the model's forward passes (the continuous-batching engine's steps too), so that a
    scoring pass beside the engine runs between its steps, never with one."""
    lock = getattr(model, "_resformer_serve_forward_lock", None)
    if lock is None:
        lock = threading.RLock()
        forward = model.forward

        @functools.wraps(forward)  # its signature stays the forward's (transformers inspects it)
        def locked_forward(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return forward(*args, **kwargs)

        model.forward = locked_forward
        model._resformer_serve_forward_lock = lock
    return lock


__all__ = [
    "MAX_COMPLETION_LOGPROBS",
    "MAX_TOP_LOGPROBS",
    "RequestOutputs",
    "chat_logprobs",
    "completion_logprobs",
    "logprobs_problem",
    "outputs_handler",
    "outputs_manager",
    "score",
]
