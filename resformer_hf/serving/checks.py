"""What `resformer-serve` checks in an OpenAI-style generation request before `transformers serve` sees it.

`transformers serve` answers some requests it cannot run with a 500 or a crashed continuous-batching worker (no
prompt, a prompt of 0 tokens), reads others in a way the OpenAI API does not define (a negative temperature served
greedily, `n` ignored) and refuses token-id prompts that the API allows. Each function here returns the message of a
400, or the request in the one form the server is then given; `check_request` runs them all on one request. Plain
functions of the body and the model's tokenizer and sizes, so that `server` runs them off the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .logprobs import logprobs_problem
from .sampling import batching_problem
from .stops import stop_problem

#: The endpoints whose bodies are checked, and the fields that bound the number of new tokens there.
GENERATION_ENDPOINTS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}
#: Endpoints with OpenAI's `n` (choices per prompt).
CHOICE_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
#: Most choices (prompts × n) one request may ask for: OpenAI's own bound on `n`. Each is one generation.
MAX_CHOICES = 128
#: OpenAI's `max_tokens` when a /v1/completions request leaves it out (a chat's is the rest of the context).
DEFAULT_COMPLETION_TOKENS = 16

Prompt = str | list[int]


@dataclass
class Plan:
    """A checked request: the body to send on, and for a completion the prompts it holds (OpenAI allows a string, a
    list of strings, a list of token ids, or a list of token-id lists) and `n`, the choices per prompt."""

    body: dict
    prompts: list[Prompt] = field(default_factory=list)
    n: int = 1

    @property
    def choices(self) -> int:
        return max(len(self.prompts), 1) * self.n


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field_problem(path: str, body: dict) -> str | None:
    """A token bound that is not a positive integer, or a sampling field outside the range OpenAI's API gives it:
    temperature in [0, 2], top_p in (0, 1], seed a 64-bit integer, n a positive integer."""
    for name in GENERATION_ENDPOINTS[path]:
        value = body.get(name)
        scoring = path == "/v1/completions" and _is_int(value) and value == 0  # echo's scoring (`logprobs`)
        if value is not None and (not _is_int(value) or value < 1) and not scoring:
            return f"{name} must be a positive integer (the number of tokens to generate), got {value!r}"
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        return f"temperature must be a number from 0 to 2 (0: greedy), got {temperature!r}"
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        return f"top_p must be a number greater than 0 and at most 1, got {top_p!r}"
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        return f"seed must be a 64-bit integer (the same seed, settings and prompt draw the same text), got {seed!r}"
    n = body.get("n")
    if path in CHOICE_ENDPOINTS and n is not None and (not _is_int(n) or not 1 <= n <= MAX_CHOICES):
        return (f"n must be a positive integer up to {MAX_CHOICES} (the number of choices to generate for each "
                f"prompt), got {n!r}")
    return (stop_problem(body) if path in CHOICE_ENDPOINTS else None) or logprobs_problem(path, body) or \
        unhonoured_problem(path, body)


def unhonoured_problem(path: str, body: dict) -> str | None:
    """The message of a 400 for a field of OpenAI's API that the server would accept and drop: `presence_penalty`
    (not 0), `best_of` (other than `n`), `logit_bias` on /v1/completions; or a `stream_options` that is not
    `{"include_usage": true/false}`."""
    presence = body.get("presence_penalty")
    if presence is not None and presence != 0:
        return ("presence_penalty is not supported by this server (it would be ignored): drop it, or use "
                "frequency_penalty (served as transformers' repetition_penalty = 1 + frequency_penalty)")
    best_of = body.get("best_of")
    if path == "/v1/completions" and best_of is not None and best_of != (body.get("n") or 1):
        return (f"best_of is not supported by this server (it would be ignored): drop it, or ask for best_of "
                f"choices with n = {best_of!r} and pick among them")
    if path == "/v1/completions" and body.get("logit_bias") is not None:
        return ("logit_bias is not supported on /v1/completions by this server (it would be ignored): use "
                "/v1/chat/completions, or drop it")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not set(options) <= {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        return (f"stream_options takes only include_usage (true or false; the usage comes in the stream's last "
                f"chunk), got {json.dumps(options)[:100]}")
    return None


def completion_prompts(body: dict) -> list[Prompt] | str:
    """The prompts of a /v1/completions body, or the message of a 400."""
    if "prompt" not in body or body["prompt"] is None:
        return "prompt is required: give a string, a list of strings, a list of token ids or a list of such lists"
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and len(prompt) * (body.get("n") or 1) > MAX_CHOICES and not all(
            _is_int(item) for item in prompt):
        return (f"{len(prompt)} prompts × n = {body.get('n') or 1} asks for more than {MAX_CHOICES} choices: send "
                "fewer prompts per request")
    if not isinstance(prompt, list) or not prompt:
        return ("prompt must be a string, a list of strings, a list of token ids or a list of such lists, got "
                f"{json.dumps(prompt)[:100]}")
    if all(_is_int(item) for item in prompt):
        return _token_ids_problem(prompt) or [prompt]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(isinstance(item, list) and all(_is_int(token) for token in item) for item in prompt):
        for ids in prompt:
            problem = _token_ids_problem(ids)
            if problem:
                return problem
        return [list(ids) for ids in prompt]
    return ("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, not a "
            "mixture")


def _token_ids_problem(ids: list[int]) -> str | None:
    if not ids:
        return "a token-id prompt is empty: give at least one token id"
    negative = next((token for token in ids if token < 0), None)
    if negative is not None:
        return f"prompt token ids must be non-negative, got {negative}"
    return None


def messages_problem(body: dict) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "messages is required: a non-empty list of {\"role\": ..., \"content\": ...} objects"
    return None


def count_tokens(tokenizer: Any, text: str, limit: int | None, add_special_tokens: bool = True) -> tuple[int, bool]:
    """(tokens, exact): `text`'s token count, or for a text far beyond `limit` tokens a lower bound above `limit`,
    found by tokenizing a prefix cut at a space (a 5 MB prompt is refused in milliseconds instead of tens of
    seconds). The prefix's tokens are those of the text's start up to the cut word, hence the margin."""
    if limit is not None:
        size = 16 * (limit + 16)
        while size < len(text):
            cut = text.rfind(" ", size // 2, size)
            prefix = text[: cut if cut > 0 else size]
            tokens = len(tokenizer(prefix, add_special_tokens=add_special_tokens)["input_ids"])
            if tokens > 2 * limit + 16:
                return tokens, False
            size *= 4
    return len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), True


def length_problem(tokens: int, exact: bool, context: int | None, requested: int | None) -> str | None:
    """A prompt of 0 tokens, one beyond the model's context, or one that leaves no room for the requested tokens."""
    if tokens == 0:
        return "the prompt is 0 tokens (an empty prompt, and the tokenizer adds no BOS): give a non-empty prompt"
    if context is None:
        return None
    if not exact or tokens > context:
        amount = f"{tokens} tokens" if exact else f"more than {context} tokens"
        return (f"the prompt is {amount} but the model's context is {context} tokens (max_position_embeddings): "
                "shorten the prompt")
    if requested is not None and tokens + requested > context:
        return (f"the prompt ({tokens} tokens) plus max_tokens ({requested}) exceeds the model's context of "
                f"{context} tokens: lower max_tokens to {context - tokens} or less")
    return None


def out_of_vocabulary(ids: list[int], vocab_size: int | None) -> str | None:
    if vocab_size is None:
        return None
    outside = next((token for token in ids if token >= vocab_size), None)
    if outside is None:
        return None
    return f"prompt token id {outside} is outside the model's vocabulary (ids 0 to {vocab_size - 1})"


def text_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages with list-of-parts content collapsed to text, as the server does for a text model."""
    result = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        result.append({**message, "content": content if content is not None else ""})
    return result


@dataclass
class ModelFacts:
    """What the checks need of the served model, loaded once: its tokenizer, context and vocabulary size."""

    tokenizer: Any
    context: int | None
    vocab_size: int | None
    samples: bool = False  #: the folder's generation_config samples (a request that sets no sampling field does)


def load_model_facts(model_source: str) -> ModelFacts:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_source)
    config = AutoConfig.from_pretrained(model_source)
    try:
        samples = bool(GenerationConfig.from_pretrained(model_source).do_sample)
    except OSError:  # no generation_config.json: the server builds one from config.json, greedy
        samples = False
    config = getattr(config, "get_text_config", lambda: config)()
    return ModelFacts(tokenizer, getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None),
                      samples)


def check_request(path: str, raw: bytes, facts: ModelFacts, batching: bool = False) -> Plan | str | None:
    """The checked request (`Plan`), the message of a 400, or None for a body that is not a JSON object.
    `batching`: the server runs with continuous batching (`batching_problem`)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    problem = field_problem(path, body) or (batching_problem(body, facts.samples) if batching else None)
    if problem is not None:
        return problem
    requested = next((body[name] for name in GENERATION_ENDPOINTS[path] if body.get(name) is not None), None)
    n = (body.get("n") or 1) if path in CHOICE_ENDPOINTS else 1
    if path == "/v1/responses":
        return Plan(body)
    if path == "/v1/chat/completions":
        problem = messages_problem(body)
        if problem is not None:
            return problem
        tokens = _chat_tokens(body, facts)
        if isinstance(tokens, str):
            return tokens
        problem = length_problem(*tokens, facts.context, requested or 1) if tokens else None
        if problem is None and requested is None and tokens and facts.context is not None:
            body = {**body, "max_tokens": facts.context - tokens[0]}  # OpenAI's: the rest of the context
        return problem or Plan(body, n=n)
    prompts = completion_prompts(body)
    if isinstance(prompts, str):
        return prompts
    rooms = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            tokens, exact = count_tokens(facts.tokenizer, prompt, facts.context)
        else:
            problem = out_of_vocabulary(prompt, facts.vocab_size)
            if problem is not None:
                return problem if len(prompts) == 1 else f"prompt {index}: {problem}"
            tokens, exact = len(prompt), True
        problem = length_problem(tokens, exact, facts.context, 1 if requested is None else requested)
        if problem is not None:
            return problem if len(prompts) == 1 else f"prompt {index}: {problem}"
        if facts.context is not None:
            rooms.append(facts.context - tokens)
    if requested is None:  # OpenAI's default, within the context
        body = {**body, "max_tokens": min([DEFAULT_COMPLETION_TOKENS, *rooms])}
    return Plan({**body, "prompt": prompts[0]} if len(prompts) == 1 else body, prompts, n)


def _chat_tokens(body: dict, facts: ModelFacts) -> tuple[int, bool] | str | None:
    """(the chat prompt's tokens, exact) as `count_tokens` gives them, the message of a 400 for a model without a
    chat template, or None where the template fails (the server reports it)."""
    tokenizer = facts.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        return (f"{tokenizer.name_or_path} has no chat template: use /v1/completions with a plain prompt, or add a "
                "chat_template to its tokenizer_config.json")
    try:
        text = tokenizer.apply_chat_template(text_messages(body["messages"]), add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template error is the server's to report
        return None
    return count_tokens(tokenizer, text, facts.context, add_special_tokens=False)


__all__ = [
    "CHOICE_ENDPOINTS",
    "DEFAULT_COMPLETION_TOKENS",
    "GENERATION_ENDPOINTS",
    "MAX_CHOICES",
    "ModelFacts",
    "Plan",
    "check_request",
    "completion_prompts",
    "count_tokens",
    "field_problem",
    "length_problem",
    "load_model_facts",
    "messages_problem",
    "out_of_vocabulary",
    "text_messages",
    "unhonoured_problem",
]
