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


@pytest.mark.parametrize("field, value", [("seed", 3), ("frequency_penalty", 0.5), ("stop", ["\n"]),
                                          ("logit_bias", {"5": 2.0})])
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
