"""`resformer-serve`: each request gets what it asked for, with and without `--continuous-batching`, and under load.

Two servers run for the module: a learnable_plus folder whose generation_config says greedy (`do_sample: false`),
served with `generate()` per request, and an SVFormer folder whose generation_config samples through top-k 1 (greedy
in effect), served with continuous batching. Greedy answers are compared with `generate()` in this process on the same
folder; a seeded sample with `generate()` after the same `torch.manual_seed`. The folders' sampling is the opposite of
what the requests ask for, so that a server that follows the folder instead of the request fails.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers.utils.import_utils import is_serve_available

if not is_serve_available():
    pytest.skip("transformers serve needs FastAPI, uvicorn and openai: pip install -e '.[serve]'",
                allow_module_level=True)

from hf_serving import (  # noqa: E402
    CB_FLAGS,
    PROMPTS,
    REQUEST_TIMEOUT_S,
    Reference,
    Server,
    read_choices,
    served,
    write_folders,
)
from transformers import GenerationConfig  # noqa: E402

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
#: Sampled answers of one prompt compared with each other: at temperature 1 over this random model's near-uniform
#: next-token distribution, two equal 8-token answers are as likely as two equal 8-character random strings.
SAMPLED = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    folders = write_folders(tmp_path_factory.mktemp("hf-serving-requests"))
    GenerationConfig(do_sample=False).save_pretrained(folders["learnable_plus"])
    GenerationConfig(do_sample=True, temperature=1.0, top_k=1).save_pretrained(folders["svformer"])
    return folders


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    """(server, reference) by name: "plain", the greedy folder served with `generate()` per request; "batched", the
    top-k 1 folder served with continuous batching."""
    started = {"plain": served(folders, tmp_path_factory, "learnable_plus"),
               "batched": served(folders, tmp_path_factory, "svformer", *CB_FLAGS)}
    try:
        yield {name: next(serving) for name, serving in started.items()}
    finally:
        for serving in started.values():
            serving.close()


def _body(path: str, prompt: str, **fields) -> dict:
    asked = {"prompt": prompt} if path == COMPLETIONS else {"messages": [{"role": "user", "content": prompt}]}
    return {**asked, "max_tokens": 8, **fields}


def _text(server: Server, path: str, body: dict, stream: bool = False, headers: dict | None = None
          ) -> tuple[str, dict]:
    """(text, answer headers) of a one-choice request."""
    status, answer_headers, raw = server.exchange(path, {**body, "stream": stream}, headers)
    assert status == 200, (status, raw, server.log_tail())
    ((text, _),), _ = read_choices(path, raw, stream)
    return text, answer_headers


def _expected(reference: Reference, path: str, prompt: str, stream: bool, seed: int | None = None) -> str:
    return (reference.complete if path == COMPLETIONS else reference.chat)(prompt, stream, seed)[0]


def _together(calls: list) -> list:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result(timeout=3 * REQUEST_TIMEOUT_S) for future in futures]


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_requests_with_one_x_request_id_are_each_answered(servers, name):
    """Two requests at once with one X-Request-ID (and two `n` = 2 requests with another): each is answered with
    its own prompt's text, the client's id echoed, the server's own id in the body (a different one for each)."""
    server, reference = servers[name]
    prompts = PROMPTS[1:3]
    answers = _together([lambda prompt=prompt, stream=stream: server.exchange(
        COMPLETIONS, {**_body(COMPLETIONS, prompt, temperature=0), "stream": stream}, {"X-Request-ID": "same"})
        for prompt, stream in zip(prompts, (False, True))])
    ids = set()
    for (status, headers, raw), prompt, stream in zip(answers, prompts, (False, True)):
        assert status == 200 and headers["x-request-id"] == "same", (status, headers, raw)
        ((text, _),), _ = read_choices(COMPLETIONS, raw, stream)
        assert text == _expected(reference, COMPLETIONS, prompt, stream)
        ids.add(json.loads(raw)["id"] if not stream else json.loads(raw.decode().split("\n")[0][6:])["id"])
    assert len(ids) == 2 and "same" not in ids, ids
    fanned = _together([lambda: server.exchange(CHAT, _body(CHAT, PROMPTS[1], temperature=0, n=2),
                                                {"X-Request-ID": "twice"})] * 2)
    for status, headers, raw in fanned:
        assert status == 200 and headers["x-request-id"] == "twice", (status, raw)
        assert [choice["message"]["content"] for choice in json.loads(raw)["choices"]] == [
            _expected(reference, CHAT, PROMPTS[1], False)] * 2
    status, headers, raw = server.exchange(COMPLETIONS, _body(COMPLETIONS, "It", temperature=0))
    assert status == 200 and headers["x-request-id"] == json.loads(raw)["id"]  # no client id: the server's own
    status, headers, _ = server.exchange(COMPLETIONS, {"prompt": ""}, {"X-Request-ID": "refused"})
    assert (status, headers["x-request-id"]) == (400, "refused")


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_temperature_and_top_p_are_the_requests_whatever_the_folder_says(servers, name):
    """Temperature 0: `generate()`'s greedy text, in a batch with sampled requests too; temperature 1 (and 1.8):
    samples that differ (the plain folder says greedy, the batched one top-k 1); top_p 1e-6 at temperature 1: the
    nucleus is the most likely token, the greedy text; no sampling field: the folder's (greedy, here both)."""
    server, reference = servers[name]
    prompt = PROMPTS[2]
    greedy = {path: _expected(reference, path, prompt, False) for path in (COMPLETIONS, CHAT)}
    calls = [lambda path=path, t=t: _text(server, path, _body(path, prompt, temperature=t))[0]
             for path in (COMPLETIONS, CHAT) for t in [0] * 2 + [1] * SAMPLED + [1.8] * 2]
    answers = _together(calls)
    per_path = len(answers) // 2
    for offset, path in zip((0, per_path), (COMPLETIONS, CHAT)):
        assert answers[offset:offset + 2] == [greedy[path]] * 2, path
        sampled = answers[offset + 2:offset + per_path]
        assert len(set(sampled)) == len(sampled), (path, sampled)
    for path in (COMPLETIONS, CHAT):
        assert _text(server, path, _body(path, prompt, temperature=1, top_p=1e-6))[0] == greedy[path]
        assert _text(server, path, _body(path, prompt, top_p=1e-6))[0] == greedy[path]
        assert _text(server, path, _body(path, prompt), stream=True)[0] == _expected(reference, path, prompt, True)


def test_a_seed_gives_generates_sample_whatever_runs_beside_it(servers):
    """A seeded request draws what `generate()` draws after `torch.manual_seed(seed)`, also while unseeded sampled
    requests run beside it; another seed draws another text."""
    server, reference = servers["plain"]
    prompt = PROMPTS[1]
    seeded = [lambda seed=seed, path=path: _text(server, path, _body(path, prompt, temperature=1, seed=seed))[0]
              for seed in (3, 4) for path in (COMPLETIONS, CHAT)]
    unseeded = [lambda: _text(server, COMPLETIONS, _body(COMPLETIONS, prompt, temperature=1))[0]] * 4
    answers = _together(seeded + unseeded)[:len(seeded)]
    expected = [_expected(reference, path, prompt, False, seed) for seed in (3, 4) for path in (COMPLETIONS, CHAT)]
    assert answers == expected
    assert answers[0] != answers[2]


@pytest.mark.parametrize("field, value", [("seed", 3), ("frequency_penalty", 0.5), ("logit_bias", {"5": 2.0})])
def test_what_continuous_batching_cannot_honour_is_refused(servers, field, value):
    """Per-request settings one batching engine cannot apply get a 400 that names them, the mode the server runs in
    and its flag, instead of being dropped; the next request is served."""
    server, reference = servers["batched"]
    status, raw = server.post(CHAT if field == "logit_bias" else COMPLETIONS,
                              _body(CHAT if field == "logit_bias" else COMPLETIONS, PROMPTS[1], **{field: value}))
    message = json.loads(raw)["error"]["message"]
    assert status == 400 and field in message and "--continuous-batching" in message, (status, message)
    assert "temperature, top_p" in message  # what it does take per request
    assert _text(server, COMPLETIONS, _body(COMPLETIONS, PROMPTS[1], temperature=0))[0] == _expected(
        reference, COMPLETIONS, PROMPTS[1], False)


def test_64_mixed_requests_at_once_are_all_answered(servers):
    """64 requests at once, half to each server: completions and chat, streamed and not, greedy and at temperature
    1, over two prompts. Every one is answered; every greedy answer is `generate()`'s; the sampled answers of one
    prompt, path and server all differ."""
    cases = [(name, path, prompt, stream, temperature)
             for name in servers for path in (COMPLETIONS, CHAT) for prompt in PROMPTS[1:3]
             for stream in (False, True) for temperature in (0, 1) for _ in range(2)]
    assert len(cases) == 64
    answers = _together([lambda case=case: _text(servers[case[0]][0], case[1], _body(case[1], case[2],
                                                                                      temperature=case[4]), case[3])[0]
                         for case in cases])
    sampled: dict[tuple, list[str]] = {}
    for (name, path, prompt, stream, temperature), text in zip(cases, answers):
        if temperature == 0:
            assert text == _expected(servers[name][1], path, prompt, stream), (name, path, prompt, stream)
        else:
            sampled.setdefault((name, path, prompt), []).append(text)
    assert all(len(set(texts)) == len(texts) == 4 for texts in sampled.values()), sampled


# ---- What lm-eval and the openai SDK send (issue 57): stop, seed, logprobs, echo, defaults ----

#: The server's log-probabilities against the model's own log-softmax in this process: the same float32 forward
#: pass, so they differ by ~1e-6 at most; a wrong position or token is off by ~0.05-0.5 on these near-uniform
#: random models (log-probabilities -5.3 to -6).
LOGPROB_TOLERANCE = 1e-4


def _greedy_ids(reference: Reference, ids: list[int], tokens: int) -> list[int]:
    import torch

    output = reference.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return output[0, len(ids):].tolist()


def _log_softmax(reference: Reference, ids: list[int]):
    import torch

    with torch.no_grad():
        return reference.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _a_stop_in(text: str) -> str:
    """Two characters from the middle of `text` that occur in it first there: a stop string the text reaches."""
    for start in range(len(text) // 2, len(text) - 1):
        stop = text[start:start + 2]
        if text.find(stop) == start and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_lm_evals_generation_request_stops_where_openai_stops(servers, name):
    """lm-eval's generation request (token ids, `seed` 1234, `stop`, temperature 0): `generate()`'s greedy text up
    to the first stop string, without it, `finish_reason` "stop", the tokens counted up to the one that completed it;
    streamed the same; a stop string the text never reaches changes nothing ("length")."""
    server, reference = servers[name]
    ids = reference.tokenizer(PROMPTS[2])["input_ids"]
    generated = _greedy_ids(reference, ids, 12)
    text = reference.tokenizer.decode(generated, skip_special_tokens=True)
    stop = _a_stop_in(text)
    expected = text[:text.index(stop)]
    kept = next(k for k in range(1, len(generated) + 1)
                if stop in reference.tokenizer.decode(generated[:k], skip_special_tokens=True))
    body = {"prompt": [ids], "max_tokens": 12, "temperature": 0, "seed": 1234, "stop": ["\x00\x01", stop]}
    status, raw = server.post(COMPLETIONS, body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (expected, "stop")
    assert answer["usage"]["completion_tokens"] == kept
    status, raw = server.post(COMPLETIONS, {**body, "stop": stop, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "stop"
    status, raw = server.post(COMPLETIONS, {**body, "stop": "\x00\x01"})
    assert json.loads(raw)["choices"][0]["text"] == text and json.loads(raw)["choices"][0]["finish_reason"] == "length"
    chat = _expected(reference, CHAT, PROMPTS[1], False)
    chat_stop = _a_stop_in(chat)
    chat_answer = json.loads(server.post(CHAT, _body(CHAT, PROMPTS[1], temperature=0, stop=[chat_stop]))[1])
    assert chat_answer["choices"][0]["message"]["content"] == chat[:chat.index(chat_stop)]
    assert chat_answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_a_seed_on_a_greedy_request_is_accepted(servers, name):
    """`seed` with temperature 0 draws nothing: served (continuous batching too), `generate()`'s greedy text; under
    continuous batching a seed on a sampled request (here: no sampling field, and the folder samples) is refused."""
    server, reference = servers[name]
    for path in (COMPLETIONS, CHAT):
        assert _text(server, path, _body(path, PROMPTS[1], temperature=0, seed=0))[0] == _expected(
            reference, path, PROMPTS[1], False)
    status, raw = server.post(COMPLETIONS, _body(COMPLETIONS, PROMPTS[1], seed=0))
    if name == "batched":
        assert status == 400 and json.loads(raw)["error"]["message"].startswith("seed cannot be honoured"), raw
    else:
        assert status == 200, raw


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_log_probabilities_are_the_models_own(servers, name):
    """lm-eval's loglikelihood request (token ids, `echo`, `logprobs` 1, `max_tokens` 1, temperature 0, `seed`):
    the prompt's tokens and the generated one, each with the model's own log-probability given the tokens before it
    (the first: null), the generated one the argmax; `logprobs` 3 without `echo`: the generated tokens only, each
    with the 3 most likely; chat `top_logprobs` 2 likewise; what cannot be given (streamed) is a 400."""
    server, reference = servers[name]
    tokenizer = reference.tokenizer
    ids = tokenizer(PROMPTS[2])["input_ids"]
    status, raw = server.post(COMPLETIONS, {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                                            "temperature": 0, "seed": 1234})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    logprobs = choice["logprobs"]
    (next_token,) = _greedy_ids(reference, ids, 1)
    whole = ids + [next_token]
    expected = _log_softmax(reference, whole)
    assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode([next_token])
    assert logprobs["tokens"] == [tokenizer.decode([token]) for token in whole]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference_logprobs = [expected[i - 1, whole[i]].item() for i in range(1, len(whole))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(reference_logprobs, abs=LOGPROB_TOLERANCE, rel=0)
    assert max(logprobs["top_logprobs"][-1].values()) == pytest.approx(expected[-2].max().item(),
                                                                       abs=LOGPROB_TOLERANCE)
    assert logprobs["token_logprobs"][-1] == pytest.approx(expected[-2].max().item(), abs=LOGPROB_TOLERANCE)
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]

    status, raw = server.post(COMPLETIONS, {"prompt": PROMPTS[2], "logprobs": 3, "max_tokens": 4, "temperature": 0})
    choice = json.loads(raw)["choices"][0]
    generated = _greedy_ids(reference, ids, 4)
    expected = _log_softmax(reference, ids + generated)
    assert choice["text"] == tokenizer.decode(generated) and len(choice["logprobs"]["tokens"]) == 4
    for position, (token, top) in enumerate(zip(choice["logprobs"]["token_logprobs"],
                                                choice["logprobs"]["top_logprobs"])):
        row = expected[len(ids) + position - 1]
        assert token == pytest.approx(row[generated[position]].item(), abs=LOGPROB_TOLERANCE)
        listed = {}  # OpenAI's dict by token text: tokens that decode alike (bytes of a character) share a key
        for candidate, value in zip(row.topk(3).indices.tolist(), row.topk(3).values.tolist()):
            listed.setdefault(tokenizer.decode([candidate]), value)
        listed.setdefault(tokenizer.decode([generated[position]]), row[generated[position]].item())
        assert list(top) == list(listed) and list(top.values()) == pytest.approx(list(listed.values()),
                                                                                 abs=LOGPROB_TOLERANCE)
    assert choice["logprobs"]["text_offset"][0] == len(PROMPTS[2])

    status, raw = server.post(CHAT, _body(CHAT, PROMPTS[1], temperature=0, max_tokens=3, logprobs=True,
                                          top_logprobs=2))
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    chat_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    generated = _greedy_ids(reference, chat_ids, 3)
    expected = _log_softmax(reference, chat_ids + generated)
    assert [entry["token"] for entry in content] == [tokenizer.decode([token]) for token in generated]
    for position, entry in enumerate(content):
        row = expected[len(chat_ids) + position - 1]
        assert entry["logprob"] == pytest.approx(row[generated[position]].item(), abs=LOGPROB_TOLERANCE)
        assert [top["logprob"] for top in entry["top_logprobs"]] == pytest.approx(row.topk(2).values.tolist(),
                                                                                  abs=LOGPROB_TOLERANCE)
    for path, fields in ((COMPLETIONS, {"logprobs": 1}), (COMPLETIONS, {"echo": True}), (CHAT, {"logprobs": True})):
        status, raw = server.post(path, _body(path, PROMPTS[1], stream=True, **fields))
        assert status == 400 and f"{next(iter(fields))} cannot be streamed" in raw.decode(), raw


def _top(tokenizer, row, top: int, chosen: int) -> dict:
    """OpenAI's `top_logprobs` entry for a row of log-probabilities: the `top` most likely tokens by text, then the
    chosen one (tokens that decode alike keep the likeliest's)."""
    listed = {}
    for candidate, value in zip(row.topk(top).indices.tolist(), row.topk(top).values.tolist()):
        listed.setdefault(tokenizer.decode([candidate]), value)
    listed.setdefault(tokenizer.decode([chosen]), row[chosen].item())
    return listed


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(servers, folders, name):
    """OpenAI's legacy scoring request as the openai SDK sends it (`echo`, `logprobs` 5, `max_tokens` 0): the prompt
    back as the text, each of its tokens with the model's own log-probability given the tokens before it (the first:
    null) and the 5 most likely there, no token generated (`finish_reason` "length", 0 completion tokens); a token-id
    prompt and a one-token prompt too; `max_tokens` 0 without `echo` is a 400 that says to add it."""
    openai = pytest.importorskip("openai")
    server, reference = servers[name]
    tokenizer = reference.tokenizer
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    model = str(folders["learnable_plus" if name == "plain" else "svformer"])
    ids = tokenizer(PROMPTS[2])["input_ids"]
    expected = _log_softmax(reference, ids)
    answer = client.completions.create(model=model, prompt=PROMPTS[2], echo=True, logprobs=5, max_tokens=0)
    choice, logprobs = answer.choices[0], answer.choices[0].logprobs
    assert (choice.text, choice.finish_reason) == (PROMPTS[2], "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 0)
    assert logprobs.tokens == [tokenizer.decode([token]) for token in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([expected[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                        abs=LOGPROB_TOLERANCE, rel=0)
    for position in range(1, len(ids)):
        listed = _top(tokenizer, expected[position - 1], 5, ids[position])
        top = logprobs.top_logprobs[position]
        assert list(top) == list(listed) and list(top.values()) == pytest.approx(list(listed.values()),
                                                                                 abs=LOGPROB_TOLERANCE)
    assert logprobs.text_offset == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]

    status, raw = server.post(COMPLETIONS, {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 0})
    by_ids = json.loads(raw)["choices"][0]
    assert status == 200 and by_ids["text"] == tokenizer.decode(ids), raw
    assert by_ids["logprobs"]["token_logprobs"][1:] == pytest.approx(logprobs.token_logprobs[1:],
                                                                     abs=LOGPROB_TOLERANCE, rel=0)
    status, raw = server.post(COMPLETIONS, {"prompt": ids[:1], "echo": True, "logprobs": 5, "max_tokens": 0})
    one = json.loads(raw)["choices"][0]
    assert (status, one["logprobs"]["token_logprobs"], one["text"]) == (200, [None], tokenizer.decode(ids[:1])), raw
    status, raw = server.post(COMPLETIONS, {"prompt": PROMPTS[2], "logprobs": 5, "max_tokens": 0})
    assert status == 400 and "add echo: true" in json.loads(raw)["error"]["message"], raw
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 generates no token"):
        client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=0)


@pytest.mark.parametrize("name", ["plain", "batched"])
def test_what_the_openai_sdk_sends(servers, folders, name):
    """The openai SDK's completions and chat calls with their defaults, streamed and not: `generate()`'s greedy
    text; `max_tokens` left out is OpenAI's default (16 for completions, the rest of the context for a chat); `n`,
    `user` and `stream_options.include_usage` as OpenAI answers them; fields the server would drop get a 400 that
    names them."""
    openai = pytest.importorskip("openai")
    server, reference = servers[name]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    model = str(folders["learnable_plus" if name == "plain" else "svformer"])
    ids = reference.tokenizer(PROMPTS[1])["input_ids"]
    sixteen = reference.tokenizer.decode(_greedy_ids(reference, ids, 16), skip_special_tokens=True)
    answer = client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, user="someone")
    assert (answer.choices[0].text, answer.usage.completion_tokens) == (sixteen, 16)
    assert answer.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == reference.complete(PROMPTS[1],
                                                                                                     True)[0]
    assert chunks[-1].usage.completion_tokens == 8
    answer = client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=8, n=2)
    assert [choice.text for choice in answer.choices] == [reference.complete(PROMPTS[1])[0]] * 2
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_ids = list(reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
    rest = _greedy_ids(reference, chat_ids, 128 - len(chat_ids))
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0)
    assert answer.choices[0].message.content == reference.tokenizer.decode(rest, skip_special_tokens=True)
    assert answer.usage.completion_tokens == len(rest)
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                                 stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == reference.chat(
        PROMPTS[1], True)[0]
    for path, field, value in ((COMPLETIONS, "presence_penalty", 0.5), (COMPLETIONS, "best_of", 3),
                               (COMPLETIONS, "logit_bias", {"5": 1}), (CHAT, "presence_penalty", 1.0)):
        status, raw = server.post(path, _body(path, PROMPTS[1], **{field: value}))
        assert status == 400 and json.loads(raw)["error"]["message"].startswith(field), raw
