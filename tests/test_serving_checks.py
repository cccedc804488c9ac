"""`resformer-serve`'s request checks, sampling and answer merging, without a server (fast; the servers themselves are
tested in test_serving_hf.py and test_serving_requests.py): OpenAI's ranges for the sampling fields and its sampling
semantics, every form of `prompt`, token counts that are exact or, for a huge prompt, a bound that is right, requests
keyed by the server's own ids with one right content-length, and merged answers whose choices, usage and failures are
the parts'."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from transformers import GenerationConfig

from resformer_hf.serving.checks import (
    MAX_CHOICES,
    ModelFacts,
    check_request,
    completion_prompts,
    count_tokens,
    field_problem,
    length_problem,
)
from resformer_hf.serving.fanout import fan_out, part_bodies
from resformer_hf.serving.sampling import batching_problem, openai_sampling, per_request_sampling
from resformer_hf.serving.server import RequestChecks
from resformer_hf.serving.stops import cut_at_stop, first_stop, held_back, stopping_queue
from resformer_hf.text import sample_text, train_tokenizer


@pytest.mark.parametrize(("body", "words"), [
    ({"temperature": 0}, None), ({"temperature": 2}, None), ({"temperature": 0.7}, None),
    ({"temperature": -1}, "temperature"), ({"temperature": 2.01}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": "1"}, "temperature"), ({"top_p": 1}, None),
    ({"top_p": 0.1}, None), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.5}, "top_p"),
    ({"n": 1}, None), ({"n": MAX_CHOICES}, None), ({"n": 0}, "n must"), ({"n": 2.0}, "n must"),
    ({"n": MAX_CHOICES + 1}, "n must"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None, "temperature": None, "top_p": None, "n": None}, None),
    ({"seed": 7}, None), ({"seed": -1}, None), ({"seed": 1.5}, "seed must"), ({"seed": "7"}, "seed must"),
    ({"seed": 2**64}, "seed must"), ({"seed": True}, "seed must"),
])
def test_sampling_fields_follow_openais_ranges(body, words):
    problem = field_problem("/v1/completions", body)
    assert (problem is None) if words is None else (words in problem), problem


@pytest.mark.parametrize(("prompt", "expected"), [
    ("It", ["It"]), ("", [""]), (["a", "b"], ["a", "b"]), ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]]),
    (None, "prompt is required"), ([], "prompt must be"), ([[]], "empty"), ([-1], "non-negative"),
    (["a", [5]], "not a mixture"), ([True], "not a mixture"), ({"text": "x"}, "prompt must be"),
    ([[5], ["a"]], "not a mixture"), (["x"] * (MAX_CHOICES + 1), "more than"),
])
def test_every_form_of_prompt(prompt, expected):
    got = completion_prompts({} if prompt is None else {"prompt": prompt})
    assert got == expected if isinstance(expected, list) else expected in got, got


def test_zero_tokens_and_the_context_make_a_400():
    assert "0 tokens" in length_problem(0, True, 128, None)
    assert "129 tokens" in length_problem(129, True, 128, None)
    assert "more than 128 tokens" in length_problem(400, False, 128, None)
    assert "lower max_tokens to 28" in length_problem(100, True, 128, 29)
    assert length_problem(100, True, 128, 28) is None and length_problem(5, True, None, 10**9) is None


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([sample_text(100_000)], 512)


@pytest.mark.parametrize("limit", [16, 128])
def test_token_counts_are_exact_or_a_true_bound(tokenizer, limit):
    """For texts of every length around and far beyond the limit (with and without spaces): an exact count equals
    the tokenizer's, and a bound is above the limit and at most the text's real count."""
    corpus = sample_text(400_000)
    generator = random.Random(0)
    texts = [corpus[start:start + length] for length in (0, 1, 50, 16 * limit, 40 * limit, 200 * limit, 300_000)
             for start in (generator.randrange(100_000) for _ in range(3))]
    texts += ["x" * 100_000, ("ab" * 20 + " ") * 10_000]
    bounds = 0
    for text in texts:
        tokens, exact = count_tokens(tokenizer, text, limit)
        real = len(tokenizer(text)["input_ids"])
        if exact:
            assert tokens == real, (len(text), tokens, real)
        else:
            bounds += 1
            assert limit < tokens <= real, (len(text), tokens, real)
    assert bounds >= 6  # the long texts took the short path


def test_part_bodies_are_one_choice_each():
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 3}
    assert part_bodies(body, ["a", "b"], 2) == [{"prompt": p, "max_tokens": 3} for p in ("a", "a", "b", "b")]
    assert part_bodies({"messages": [], "n": 3}, None, 3) == [{"messages": []}] * 3


def _echo_app(fail_on: str | None = None):
    """An ASGI app answering as `transformers serve` does, with the prompt upper-cased (status 503 for `fail_on`)."""
    async def app(scope, receive, send):
        raw = (await receive())["body"]
        body = json.loads(raw)
        headers = dict(scope["headers"])
        lengths = [value for key, value in scope["headers"] if key.lower() == b"content-length"]
        assert lengths == [str(len(raw)).encode()], lengths  # one content-length, the body's
        prompt = body["prompt"]
        if prompt == fail_on:
            payload = json.dumps({"error": "CB worker is dead"}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": payload})
            return
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": len(prompt) + 2}
        choice = {"index": 0, "text": prompt.upper(), "finish_reason": "length"}
        reply = {"id": headers[b"x-request-id"].decode(), "object": "text_completion", "choices": [choice]}
        if not body.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": json.dumps({**reply, "usage": usage}).encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in prompt.upper():
            await asyncio.sleep(0)
            chunk = {**reply, "choices": [{"index": 0, "text": piece}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        last = {**reply, "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(last)}\n\n".encode()})
    return app


def _run(app, prompts: list[str], n: int, stream: bool) -> tuple[int, bytes]:
    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    body = {"prompt": prompts, "n": n, "stream": stream}
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"x-request-id", b"r"), (b"content-length", str(len(json.dumps(body))).encode())]}
    asyncio.run(fan_out(app, scope, receive, send, part_bodies(body, prompts, n), n, stream))
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_merged_answers_number_the_choices_and_sum_the_usage(stream):
    status, raw = _run(_echo_app(), ["ab", "cde"], 2, stream)
    assert status == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        usage = [chunk["usage"] for chunk in chunks if "usage" in chunk]
        assert len(usage) == 1 and chunks[-1]["choices"] == []
        usage = usage[0]
        ids = {chunk["id"] for chunk in chunks}
    else:
        reply = json.loads(raw)
        texts = {choice["index"]: choice["text"] for choice in reply["choices"]}
        usage, ids = reply["usage"], {reply["id"]}
    assert texts == {0: "AB", 1: "AB", 2: "CDE", 3: "CDE"}
    assert usage == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}  # each prompt once
    assert ids == {"r"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_part_fails_the_request_with_its_status_and_message(stream):
    status, raw = _run(_echo_app(fail_on="cde"), ["ab", "cde"], 1, stream)
    assert (status, json.loads(raw)) == (503, {"error": "CB worker is dead"})


FOLDERS = {"greedy": GenerationConfig(do_sample=False),
           "filtered": GenerationConfig(do_sample=True, temperature=0.3, top_k=1, top_p=0.2, min_p=0.5)}
OPENAI_T1 = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize(("body", "expected"), [
    ({"temperature": 0}, {"do_sample": False}),
    ({"temperature": 0, "top_p": 0.5}, {"do_sample": False}),
    ({"temperature": 1.8}, {**OPENAI_T1, "temperature": 1.8}),
    ({"temperature": 1}, OPENAI_T1),
    ({"top_p": 0.5}, {**OPENAI_T1, "top_p": 0.5}),
    ({"temperature": 0.7, "top_p": 0.9}, {**OPENAI_T1, "temperature": 0.7, "top_p": 0.9}),
])
def test_a_request_that_names_its_sampling_gets_openais(folder, body, expected):
    """Whatever the folder says (greedy, or sampling through filters): temperature 0 is greedy, > 0 samples at that
    temperature from the nucleus top_p with no other filter; a request that names neither keeps the folder's."""
    config = openai_sampling(body, GenerationConfig(**FOLDERS[folder].to_diff_dict()))
    assert {name: getattr(config, name) for name in expected} == expected
    untouched = openai_sampling({"max_tokens": 3, "seed": 4}, GenerationConfig(**FOLDERS[folder].to_diff_dict()))
    assert untouched.to_diff_dict() == FOLDERS[folder].to_diff_dict()


def test_continuous_batching_samples_each_request_as_generate_would():
    """The batching engine's per-request settings: greedy is top-k 1; a field left unset is `generate()`'s default
    (temperature 1, top-k 50, top-p 1); OpenAI's "no top-k" keeps every token, a top-k beyond the vocabulary too."""
    greedy = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
    assert per_request_sampling(GenerationConfig(do_sample=False), 512) == greedy
    assert per_request_sampling(GenerationConfig(do_sample=True), 512) == {"temperature": 1.0, "top_k": 50,
                                                                           "top_p": 1.0}
    assert per_request_sampling(GenerationConfig(do_sample=True), 32)["top_k"] == 32
    openai = openai_sampling({"temperature": 0.7, "top_p": 0.9}, GenerationConfig(do_sample=False))
    assert per_request_sampling(openai, 512) == {"temperature": 0.7, "top_k": 512, "top_p": 0.9}
    assert all(type(value) is type(default) for value, default in zip(
        per_request_sampling(openai, 512).values(), (1.0, 1, 1.0)))  # the engine checks the types


def test_what_one_batching_engine_cannot_do_is_named_with_the_flag():
    assert batching_problem({"temperature": 1.5, "top_p": 0.5, "max_tokens": 3, "prompt": "x"}) is None
    message = batching_problem({"seed": 1, "logit_bias": {"5": 1}, "stop": ["."], "temperature": 1})
    assert message.startswith("seed, logit_bias cannot be honoured") and "--continuous-batching" in message
    assert "takes only temperature, top_p and max_tokens per request" in message


@pytest.mark.parametrize(("body", "folder_samples", "refused"), [
    ({"seed": 0, "temperature": 0}, True, False), ({"seed": 1234, "temperature": 0.0}, False, False),
    ({"seed": 3}, False, False), ({"seed": 3}, True, True), ({"seed": 3, "temperature": 0.5}, False, True),
    ({"seed": 3, "top_p": 0.5}, False, True), ({"seed": 3, "temperature": 0, "top_p": 0.5}, True, False),
    ({"stop": ["\n"], "temperature": 1}, True, False),
])
def test_a_seed_is_refused_by_the_batching_engine_only_where_it_draws(body, folder_samples, refused):
    """A seed on a greedy request (temperature 0, or no sampling field and a greedy folder) draws nothing: accepted;
    on a sampled one, refused with its name. `stop` is served by both engines."""
    problem = batching_problem(body, folder_samples)
    assert (problem is not None) == refused, problem
    assert problem is None or problem.startswith("seed cannot be honoured")


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/completions", {"stop": "\n"}, None), ("/v1/completions", {"stop": ["a", "bc"]}, None),
    ("/v1/completions", {"stop": ""}, "stop must"), ("/v1/completions", {"stop": ["a", 3]}, "stop must"),
    ("/v1/completions", {"stop": ["x"] * 17}, "at most 16"), ("/v1/chat/completions", {"stop": [""]}, "stop must"),
    ("/v1/completions", {"logprobs": 0, "echo": True}, None), ("/v1/completions", {"logprobs": 5}, None),
    ("/v1/completions", {"logprobs": 6}, "logprobs must"), ("/v1/completions", {"logprobs": True}, "logprobs must"),
    ("/v1/completions", {"echo": "yes"}, "echo must"),
    ("/v1/completions", {"logprobs": 1, "stream": True}, "logprobs cannot be streamed"),
    ("/v1/completions", {"echo": True, "stream": True}, "echo cannot be streamed"),
    ("/v1/completions", {"echo": True, "logprobs": 5, "max_tokens": 0}, None),  # legacy scoring (issue 68)
    ("/v1/completions", {"echo": True, "max_tokens": 0}, None),
    ("/v1/completions", {"logprobs": 5, "max_tokens": 0}, "logprobs with max_tokens 0 and no echo"),
    ("/v1/completions", {"logprobs": 5, "echo": False, "max_tokens": 0}, "add echo: true to score the prompt"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens 0 generates no token"),
    ("/v1/completions", {"echo": True, "max_tokens": False}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"echo": True, "max_tokens": -1}, "max_tokens must be a positive integer"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"logprobs": None, "echo": False, "stream": True}, None),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 20}, None),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs must be true or false"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "stream": True}, "logprobs cannot be streamed"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"presence_penalty": 0}, None),
    ("/v1/completions", {"best_of": 2}, "best_of"), ("/v1/completions", {"best_of": 2, "n": 2}, None),
    ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 1}}, None),
    ("/v1/completions", {"user": "me", "stream_options": {"include_usage": True}}, None),
    ("/v1/completions", {"stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/chat/completions", {"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
])
def test_stop_logprobs_echo_and_unhonoured_fields_are_checked(path, body, words):
    problem = field_problem(path, body)
    assert (problem is None) if words is None else (words in problem), problem


def test_a_missing_max_tokens_is_openais_default_within_the_context(tokenizer):
    """/v1/completions: 16 tokens, or the room the longest prompt leaves; chat: the rest of the context. A prompt
    that fills the context gets a 400 (no room for one token)."""
    facts = ModelFacts(tokenizer, 128, len(tokenizer))
    assert check_request("/v1/completions", json.dumps({"prompt": [5] * 10}).encode(), facts).body["max_tokens"] == 16
    assert check_request("/v1/completions", json.dumps({"prompt": [[5] * 10, [5] * 120]}).encode(),
                         facts).body["max_tokens"] == 8
    assert check_request("/v1/completions", json.dumps({"prompt": [5], "max_tokens": 50}).encode(),
                         facts).body["max_tokens"] == 50
    assert "lower max_tokens" in check_request("/v1/completions", json.dumps({"prompt": [5] * 128}).encode(), facts)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        chat = check_request("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hello"}]}
                                                                ).encode(), facts)
        assert chat.body["max_tokens"] == 128 - len(tokenizer("Hello", add_special_tokens=False)["input_ids"])
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize(("text", "stops", "first", "held"), [
    ("abc", ["c"], 2, 0), ("abc", ["x", "bc", "b"], 1, 0), ("ab", ["bcd"], None, 1), ("abc", ["cd", "bcx"], None, 2),
    ("", ["a"], None, 0), ("a\n", ["\n\n"], None, 1), ("aaa", ["b"], None, 0),
    ("agh", ["h", "gh"], 2, 0), ("agh", ["gh", "h"], 1, 0), ("xaby", ["aby", "b"], 2, 0),
])
def test_stop_strings_are_found_first_and_their_starts_held_back(text, stops, first, held):
    assert first_stop(text, stops) == first
    assert held_back(text, stops) == held


def test_a_stop_cuts_the_text_and_counts_tokens_to_the_one_that_completed_it(tokenizer):
    ids = tokenizer("one two three four five six")["input_ids"]
    text = tokenizer.decode(ids)
    index = text.index("four")
    expected_tokens = next(k for k in range(1, len(ids) + 1) if "four" in tokenizer.decode(ids[:k]))
    assert cut_at_stop(tokenizer, text, ids, ["four", "zzz"]) == (text[:index], expected_tokens)
    assert cut_at_stop(tokenizer, text, ids, ["zzz"]) is None


def test_a_stream_ends_at_the_first_stop_string_and_cancels_its_generation():
    """Pieces that end inside a stop string are held back; the stop string and what follows never arrive; the
    generation is cancelled; a stream without one is passed on whole."""

    class Streamer:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    async def run(pieces, stops):
        queue, streamer = asyncio.Queue(), Streamer()
        for piece in pieces:
            queue.put_nowait(piece)
        out, got = stopping_queue(queue, streamer, stops), []
        while (item := await asyncio.wait_for(out.get(), 5)) is not None:
            got.append(item)
        return got, streamer.cancelled

    assert asyncio.run(run(["Hel", "lo wo", "rld. More", " text", None], ["world.", "xyz"])) == (
        ["Hel", "lo "], True)
    assert asyncio.run(run(["a", "b\n", "c", None], ["\n\n"])) == (["a", "b", "\nc"], False)
    assert asyncio.run(run(["ab", "c", None], ["cd"])) == (["ab", "c"], False)


def _checked(tokenizer, requests: list[tuple[dict, list]]) -> tuple[list[dict], list[list[dict]]]:
    """(the scope and body the app saw, the messages each client got) for `requests` (body, headers) sent at once
    through `RequestChecks` to an app that answers 200 with the id it was given."""
    seen = []

    async def app(scope, receive, send):
        raw = (await receive())["body"]
        seen.append({"headers": scope["headers"], "body": raw})
        request_id = dict(scope["headers"])[b"x-request-id"]
        await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", request_id)]})
        await send({"type": "http.response.body", "body": json.dumps({"id": request_id.decode()}).encode()})

    checks = RequestChecks(app, "unused")
    checks._facts = ModelFacts(tokenizer, 128, len(tokenizer))

    async def one(body: dict, headers: list) -> list[dict]:
        raw, sent = json.dumps(body).encode(), []

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        await checks(scope, receive, send)
        return sent

    async def all_at_once():
        return await asyncio.gather(*(one(body, headers) for body, headers in requests))

    return seen, asyncio.run(all_at_once())


def test_requests_are_keyed_by_the_servers_own_ids_and_carry_one_content_length(tokenizer):
    """Two requests at once with one X-Request-ID reach the server under two ids of its own; each client gets its
    X-Request-ID back (one that gave none gets the server's). The checks rewrite the body (a one-prompt list becomes
    the prompt), and the server sees that body's content-length only."""
    client = [(b"X-Request-ID", b"same")]
    seen, answers = _checked(tokenizer, [({"prompt": ["It"], "max_tokens": 2}, client),
                                         ({"prompt": ["It is"], "max_tokens": 2}, client),
                                         ({"prompt": "It", "max_tokens": 2}, [])])
    ids = [dict(request["headers"])[b"x-request-id"] for request in seen]
    assert len(set(ids)) == 3 and b"same" not in ids, ids
    for request in seen:
        lengths = [value for key, value in request["headers"] if key.lower() == b"content-length"]
        assert lengths == [str(len(request["body"])).encode()], lengths
        assert [key for key, _ in request["headers"]].count(b"x-request-id") == 1
    assert sorted(json.loads(request["body"])["prompt"] for request in seen) == ["It", "It", "It is"]
    echoed = [[value for key, value in sent[0]["headers"] if key == b"x-request-id"] for sent in answers]
    assert echoed[:2] == [[b"same"], [b"same"]]
    assert echoed[2] == [json.loads(answers[2][1]["body"])["id"].encode()]  # no client id: the server's own


# ---- OpenAI's error shape on every error (issue 68) ----

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


class _PinnedModels:
    """The model manager of `transformers serve FOLDER` as far as a request's checks reach it: pinned to "tiny";
    `fail` is raised where it would load the model (the batching worker's death, a crash)."""

    force_model = "tiny"

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail

    def process_model_name(self, model: str) -> str:
        raise self.fail or AssertionError("the test never gets this far")


def _hf_app(fail: Exception | None = None):
    """transformers' own server app (`build_server`) with its own completions handler, wrapped as `RequestChecks`
    wraps it (`openai_errors`); the other handlers are never reached."""
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.utils import GenerationState

    from resformer_hf.serving.openai_errors import openai_errors

    models, state = _PinnedModels(fail), GenerationState()
    app = build_server(models, None, CompletionHandler(models, state), None, None, None, state)

    async def wrapped(scope, receive, send):
        await app(scope, receive, openai_errors(scope, send))

    return wrapped


def _call(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000), "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError as error:  # Starlette answers a crash with its 500, then re-raises it for the log
        assert "injected" in str(error), error
    start = next(message for message in sent if message["type"] == "http.response.start")
    raw = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), raw


@pytest.mark.parametrize(("what", "method", "path", "body", "status", "words"), [
    ("unknown field", "POST", "/v1/completions", {"prompt": "It", "colour": "red"}, 400,
     "Unrecognized request argument supplied: colour"),
    ("two unknown fields", "POST", "/v1/completions", {"prompt": "It", "b": 1, "a": 2}, 400,
     "arguments supplied: a, b"),
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": "It", "max_tokens": ', 400,
     "not valid JSON (JSON decode error at character 31: Expecting value)"),
    ("body not an object", "POST", "/v1/completions", b"[1, 2]", 400, "body: Input should be a valid dictionary"),
    ("wrong model", "POST", "/v1/completions", {"prompt": "It", "model": "other"}, 404,
     "Server is pinned to 'tiny'; requested 'other'"),
    ("unknown path", "POST", "/v1/complete", {"prompt": "It"}, 404, "POST /v1/complete is not an endpoint"),
    ("wrong method", "GET", "/v1/completions", b"", 405, "Method Not Allowed: GET /v1/completions"),
])
def test_every_error_of_transformers_serve_has_openais_shape_and_a_fitting_status(what, method, path, body, status,
                                                                                  words):
    raw_body = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, headers, raw = _call(_hf_app(), method, path, raw_body)
    error = json.loads(raw)["error"]
    assert (got_status, set(error), error["type"]) == (status, OPENAI_ERROR_KEYS, "invalid_request_error"), (what, raw)
    assert words in error["message"], (what, error["message"])
    assert headers[b"content-length"] == str(len(raw)).encode() and headers[b"content-type"] == b"application/json"
    if what.endswith("unknown field"):
        assert error["param"] == "colour"
    if what == "wrong model":
        assert (error["param"], error["code"]) == ("model", "model_not_found")


def test_the_servers_own_failures_are_server_errors_in_openais_shape():
    from transformers.cli.serving.utils import CBWorkerDeadError

    body = json.dumps({"prompt": "It"}).encode()
    for fail, status, words in ((CBWorkerDeadError("CB worker is dead and cannot accept request r"), 503,
                                 "CB worker is dead"),
                                (RuntimeError("injected failure"), 500, "the server failed on this request")):
        got_status, _, raw = _call(_hf_app(fail), "POST", "/v1/completions", body)
        error = json.loads(raw)["error"]
        assert (got_status, set(error), error["type"]) == (status, OPENAI_ERROR_KEYS, "server_error"), raw
        assert words in error["message"], raw


def test_a_streams_error_event_and_a_shaped_error_keep_their_message():
    """HF's stream error event (`data: {"error": "<message, unescaped>"}`) becomes OpenAI's error object; an answer
    already in OpenAI's shape (the checks' 400, a merged request's failed part) keeps its status and message."""
    from resformer_hf.serving.openai_errors import openai_errors

    def app_sending(status: int, content_type: bytes, *bodies: bytes):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
            for index, body in enumerate(bodies):
                await send({"type": "http.response.body", "body": body, "more_body": index < len(bodies) - 1})

        async def wrapped(scope, receive, send):
            await app(scope, receive, openai_errors(scope, send))
        return wrapped

    chunk = b'data: {"id": "r", "choices": [{"text": "a"}]}\n\n'
    status, _, raw = _call(app_sending(200, b"text/event-stream", chunk, b'data: {"error": "bad "x" input"}\n\n'),
                           "POST", "/v1/completions")
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[0] == json.loads(chunk[6:])
    assert events[1] == {"error": {"message": 'bad "x" input', "type": "server_error", "param": None, "code": None}}
    shaped = json.dumps({"error": {"message": "prompt is required"}}).encode()
    status, _, raw = _call(app_sending(400, b"application/json", shaped[:5], shaped[5:]), "POST", "/v1/completions")
    assert (status, json.loads(raw)) == (400, {"error": {"message": "prompt is required",
                                                         "type": "invalid_request_error", "param": None,
                                                         "code": None}})
    status, _, raw = _call(app_sending(200, b"application/json", b'{"error": "not an error answer"}'), "GET", "/x")
    assert (status, raw) == (200, b'{"error": "not an error answer"}')
