"""`resformer-serve`: Hugging Face's own OpenAI-compatible server (`transformers serve`) on a ResFormer folder.

Each server runs in its own process on 127.0.0.1 and is stopped by the test module (SIGTERM, then SIGKILL). Its
greedy text is compared with `generate()` in this process on the same folder (text and token count), for
/v1/completions and /v1/chat/completions, streaming and not, for 8 concurrent requests, with and without
`--continuous-batching`; a Llama folder of the same shape served the same way is the control. Bad requests get a 4xx
with a message in OpenAI's error shape, and the next request is served; token-id prompts and `n` > 1 are served as
OpenAI's API defines them; a 5 MB prompt does not stall the server; a dead continuous-batching worker stops it with
status 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers.utils.import_utils import is_serve_available

if not is_serve_available():
    pytest.skip("transformers serve needs FastAPI, uvicorn and openai: pip install -e '.[serve]'",
                allow_module_level=True)

import torch  # noqa: E402
from bases import BASES  # noqa: E402
from hf_serving import (  # noqa: E402
    CB_FLAGS,
    CONCURRENT,
    MAX_TOKENS,
    PROMPTS,
    REPO,
    REQUEST_TIMEOUT_S,
    Reference,
    Server,
    served,
    write_folders,
)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from resformer_hf.hub import save_for_hub  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory.mktemp("hf-serving"))


@pytest.fixture(scope="module")
def plain(folders, tmp_path_factory):
    """learnable_plus served with `model.generate()` per request."""
    yield from served(folders, tmp_path_factory, "learnable_plus")


@pytest.fixture(scope="module")
def batched(folders, tmp_path_factory):
    """SVFormer served with continuous batching."""
    yield from served(folders, tmp_path_factory, "svformer", *CB_FLAGS)


@pytest.fixture(scope="module")
def gated(folders, tmp_path_factory):
    """`gated` (random value gates) served with continuous batching."""
    yield from served(folders, tmp_path_factory, "gated", *CB_FLAGS)


@pytest.fixture(scope="module")
def value_embeddings(folders, tmp_path_factory):
    """Value embeddings (random tables and gates) served with continuous batching."""
    yield from served(folders, tmp_path_factory, "value_embeddings", *CB_FLAGS)


@pytest.fixture(scope="module")
def control(folders, tmp_path_factory):
    """The Llama control, with continuous batching."""
    yield from served(folders, tmp_path_factory, "llama", *CB_FLAGS)


@pytest.fixture(scope="module")
def base_folders(tmp_path_factory) -> dict:
    """Each base of issue 67 converted to learnable_plus (`bases.py`), λ off their initial values, as a Hub folder
    with the base's tokenizer and chat template."""
    from bases import converted

    root, folders = tmp_path_factory.mktemp("bases"), {}
    for name in BASES:
        source = converted(name, root, "learnable_plus")
        model = AutoModelForCausalLM.from_pretrained(source)
        with torch.no_grad():
            for parameter in model.model.value_residual.parameters():
                parameter.uniform_(-0.4, 0.4, generator=torch.Generator().manual_seed(0))
        folders[name] = save_for_hub(model, root / f"{name}-served", tokenizer=AutoTokenizer.from_pretrained(source))
    return folders


@pytest.mark.parametrize("name, flags", [(name, ()) for name in BASES] + [
    (name, CB_FLAGS) for name in ("gemma3", "olmo3", "mistral")])
def test_each_base_is_served_as_generate_answers(base_folders, tmp_path, name, flags):
    """Issue 67: `resformer-serve` answers completions (token-id prompts, the longest past every window, and text)
    and a chat request with `generate()`'s greedy tokens for each base; with continuous batching for the bases with
    window layers, which its paged cache handles apart (the others' layers are a Llama's there)."""
    server = Server(base_folders[name], tmp_path / "server.log", *flags)
    try:
        reference = Reference(base_folders[name])
        for prompt in ([5, 9], list(range(3, 30)), PROMPTS[2]):
            assert server.complete(prompt) == reference.complete(prompt), prompt
        assert server.chat(PROMPTS[1]) == reference.chat(PROMPTS[1])
    finally:
        server.close()


def _concurrently(server: Server, prompts: list[str]) -> list[tuple[str, int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(server.complete, prompt, index % 2 == 1) for index, prompt in enumerate(prompts)]
        return [future.result(timeout=3 * REQUEST_TIMEOUT_S) for future in futures]


def test_completions_and_chat_equal_generate(plain):
    server, reference = plain
    for prompt in PROMPTS:
        assert reference.complete(prompt)[1] > 0
        assert server.complete(prompt) == reference.complete(prompt), prompt
        assert server.complete(prompt, stream=True) == reference.complete(prompt, stream=True), prompt
    for content in PROMPTS[1:3]:
        assert server.chat(content) == reference.chat(content), content
        assert server.chat(content, stream=True) == reference.chat(content, stream=True), content


@pytest.mark.parametrize("fixture", ["plain", "batched", "gated", "value_embeddings", "control"])
def test_concurrent_requests_equal_generate(fixture, request):
    server, reference = request.getfixturevalue(fixture)
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(CONCURRENT)]
    expected = [reference.complete(prompt, stream=index % 2 == 1) for index, prompt in enumerate(prompts)]
    assert len({reference.complete(prompt) for prompt in PROMPTS}) == len(PROMPTS)  # not one continuation for all
    assert _concurrently(server, prompts) == expected
    if fixture == "batched":
        assert server.chat(PROMPTS[2], stream=True) == reference.chat(PROMPTS[2], stream=True)


#: Requests the model cannot run or the server would misread: (endpoint, body, words of the 400's message).
BAD_REQUESTS = {
    "empty prompt (0 tokens: this tokenizer adds no BOS)": ("/v1/completions", {"prompt": ""}, "0 tokens"),
    "no prompt": ("/v1/completions", {"max_tokens": 4}, "prompt is required"),
    "negative temperature": ("/v1/completions", {"prompt": "It", "temperature": -1}, "temperature must be"),
    "temperature above 2": ("/v1/completions", {"prompt": "It", "temperature": 2.5}, "temperature must be"),
    "temperature not a number": ("/v1/completions", {"prompt": "It", "temperature": "hot"}, "temperature must be"),
    "top_p 0": ("/v1/completions", {"prompt": "It", "top_p": 0}, "top_p must be"),
    "top_p above 1": ("/v1/completions", {"prompt": "It", "top_p": 1.5}, "top_p must be"),
    "n 0": ("/v1/completions", {"prompt": "It", "n": 0}, "n must be a positive integer"),
    "n not an integer": ("/v1/completions", {"prompt": "It", "n": 1.5}, "n must be a positive integer"),
    "empty token-id prompt": ("/v1/completions", {"prompt": [[]]}, "token-id prompt is empty"),
    "token id beyond the vocabulary": ("/v1/completions", {"prompt": [10**6]}, "outside the model's vocabulary"),
    "prompts of mixed kinds": ("/v1/completions", {"prompt": ["It", [5]]}, "not a mixture"),
    "chat without messages": ("/v1/chat/completions", {"max_tokens": 4}, "messages is required"),
    "chat with top_p 0": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0},
                          "top_p must be"),
    "chat with n 0": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 0},
                      "n must be a positive integer"),
}


@pytest.mark.parametrize("fixture", ["plain", "batched", "control"])
def test_bad_requests_get_a_4xx_with_a_message_and_the_next_is_served(fixture, request):
    """Each bad request gets a 4xx with a message, and the server (its continuous-batching worker too) serves the
    next request with `generate()`'s tokens."""
    server, reference = request.getfixturevalue(fixture)
    too_long = " ".join(["the quick brown fox"] * 100)
    bad = {
        "malformed JSON": ("/v1/completions", b'{"prompt": "It", "max_tokens": ', "JSON decode error", 400),
        "prompt beyond the context": ("/v1/completions", {"prompt": too_long, "max_tokens": 4},
                                      "context is 128 tokens", 400),
        "negative max_tokens": ("/v1/completions", {"prompt": "It", "max_tokens": -1},
                                "max_tokens must be a positive integer", 400),
        "prompt + max_tokens beyond the context": ("/v1/completions", {"prompt": "It", "max_tokens": 500},
                                                   "lower max_tokens", 400),
        "chat beyond the context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]},
                                    "shorten the prompt", 400),
        **{what: (*case, 400) for what, case in BAD_REQUESTS.items()},
    }
    expected = reference.complete(PROMPTS[1])
    for what, (path, body, message, status) in bad.items():
        got_status, raw = server.post(path, body)
        error = json.loads(raw)["error"]  # OpenAI's shape, the server's own errors too
        assert (got_status, message in error["message"], set(error)) == (status, True, OPENAI_ERROR_KEYS), (
            what, got_status, raw)
        assert server.complete(PROMPTS[1]) == expected, what
    assert server.get("/health")[0] == 200


#: OpenAI's error object: every error answer has it, whichever of the plugin or `transformers serve` made it.
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("fixture", ["plain", "batched", "control"])
def test_every_kind_of_error_is_answered_in_openais_shape(fixture, folders, request):
    """What `transformers serve` answers in FastAPI's shapes (an unknown field and a body that is not an object: 422,
    another model: 400 `detail`, an unknown path or method: 404/405 `detail`) gets OpenAI's error object, a 400 for
    the client's malformed request, 404 `model_not_found` for another model; the openai SDK raises its own classes."""
    server, reference = request.getfixturevalue(fixture)
    name = {"plain": "learnable_plus", "batched": "svformer", "control": "llama"}[fixture]
    kinds = {
        "unknown field": ("POST", "/v1/completions", {"prompt": "It", "colour": "red"}, 400, "colour"),
        "body not an object": ("POST", "/v1/completions", b"[1, 2]", 400, "valid dictionary"),
        "another model": ("POST", "/v1/completions", {"prompt": "It", "model": "other"}, 404, "requested 'other'"),
        "chat for another model": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                    "model": "other"}, 404, "requested 'other'"),
        "unknown path": ("POST", "/v1/complete", {"prompt": "It"}, 404, "not an endpoint"),
        "wrong method": ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
    }
    for what, (method, path, body, status, words) in kinds.items():
        got_status, raw = server.post(path, body) if method == "POST" else server.get(path)
        error = json.loads(raw)["error"]
        assert (got_status, set(error), error["type"]) == (status, OPENAI_ERROR_KEYS, "invalid_request_error"), (
            what, got_status, raw)
        assert words in error["message"], (what, error)
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="other", prompt="It", max_tokens=2)
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="colour"):
        client.completions.create(model=str(folders[name]), prompt="It", max_tokens=2, extra_body={"colour": "red"})
    assert server.complete(PROMPTS[1]) == reference.complete(PROMPTS[1])


@pytest.mark.parametrize("fixture", ["plain", "batched", "control"])
def test_token_id_prompts_are_served_as_openai_defines(fixture, request):
    """`prompt` as token ids (one list) and as several token-id lists (one choice each, in order): `generate()`'s
    tokens on those ids, streaming and not; the usage counts every prompt's tokens and every generated token."""
    server, reference = request.getfixturevalue(fixture)
    ids = [reference.tokenizer(prompt)["input_ids"] for prompt in PROMPTS[1:3]]
    assert server.complete(ids[0]) == reference.complete(ids[0])
    assert server.complete(ids[0], stream=True) == reference.complete(ids[0], stream=True)
    for stream in (False, True):
        expected = [reference.complete(prompt, stream) for prompt in ids]
        got, usage = server.choices("/v1/completions", {"prompt": ids}, stream)
        assert [text for text, _ in got] == [text for text, _ in expected], stream
        generated = sum(tokens for _, tokens in expected)
        assert usage == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": generated,
                         "total_tokens": sum(map(len, ids)) + generated}, usage


@pytest.mark.parametrize("fixture", ["plain", "batched", "control"])
def test_n_choices_are_all_generated(fixture, request):
    """`n` > 1 gets n choices (greedy here, so n equal ones), for a prompt, for a list of prompts (choice i·n + j is
    prompt i's j-th) and for a chat, streaming and not; the usage counts each prompt once."""
    server, reference = request.getfixturevalue(fixture)
    text, tokens = reference.complete(PROMPTS[1])
    prompt_tokens = len(reference.tokenizer(PROMPTS[1])["input_ids"])
    got, usage = server.choices("/v1/completions", {"prompt": PROMPTS[1], "n": 3}, stream=False)
    assert got == [(text, None)] * 3
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": 3 * tokens,
                     "total_tokens": prompt_tokens + 3 * tokens}
    got, _ = server.choices("/v1/completions", {"prompt": list(PROMPTS[1:3]), "n": 2}, stream=True)
    assert [text for text, _ in got] == [reference.complete(prompt, stream=True)[0]
                                         for prompt in PROMPTS[1:3] for _ in range(2)]
    got, _ = server.choices("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}],
                                                     "n": 2}, stream=False)
    assert got == [(reference.chat(PROMPTS[1])[0], None)] * 2


@pytest.mark.parametrize("fixture", ["plain", "batched"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_5_mb_prompt_is_refused_without_stalling_the_server(fixture, path, request):
    """The request checks run off the event loop and tokenize only as much of a huge prompt as they need: /health,
    asked again and again while a 5 MB prompt is checked, answers every time within 0.5 s (a check that tokenized
    all of it on the event loop stalled it for 10 s)."""
    server, _ = request.getfixturevalue(fixture)
    text = ("the quick brown fox jumps over the lazy dog " * 120_000)[:5_000_000]
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.post, path, {**body, "max_tokens": 4})
        waits = []
        while not answer.done() or not waits:
            start = time.monotonic()
            assert server.get("/health")[0] == 200
            waits.append(time.monotonic() - start)
        status, raw = answer.result()
    assert status == 400 and "context is 128 tokens" in raw.decode(), (status, raw[:300])
    assert max(waits) < 0.5, waits


#: Run in the server's process before the command: the model's forward fails on a prompt of 5 × SENTINEL, so the
#: continuous-batching worker dies as on a crash the request checks cannot foresee (a Llama's worker too).
SENTINEL = 7
FAIL_ON_SENTINEL = f"""
from transformers.models.llama.modeling_llama import LlamaModel
from resformer_hf.remote_code.modeling_resformer import ResFormerModel

def failing(forward):
    def wrapped(self, input_ids=None, *args, **kwargs):
        if input_ids is not None and int((input_ids == {SENTINEL}).sum()) >= 5:
            raise RuntimeError("injected failure in the model's forward")
        return forward(self, input_ids, *args, **kwargs)
    return wrapped

for model_class in (LlamaModel, ResFormerModel):
    model_class.forward = failing(model_class.forward)
"""


@pytest.mark.parametrize("name", ["svformer", "llama"])
def test_a_dead_batching_worker_stops_the_server_with_status_1(folders, tmp_path, name):
    """Instead of answering 503 to every request from then on: /health says so, and the process exits with status
    1 and a one-line error, so that a supervisor restarts it."""
    server = Server(folders[name], tmp_path / "dying.log", *CB_FLAGS, prelude=FAIL_ON_SENTINEL)
    try:
        assert server.complete(PROMPTS[1])[1] == MAX_TOKENS
        status, raw = server.post("/v1/completions", {"prompt": [SENTINEL] * 5, "max_tokens": 2})
        # 503 "CB worker died", or 500 when the server sees the failed request before the worker's death (its race:
        # transformers fails the worker's requests, then records the error that /health reads)
        assert status in (500, 503) and json.loads(raw)["error"]["type"] == "server_error", (status, raw)
        deadline, health = time.monotonic() + 5, 200
        while health == 200 and time.monotonic() < deadline:
            try:
                health = server.get("/health")[0]
            except OSError:  # the server is gone already
                health = None
            time.sleep(0.05)
        assert health in (503, None), health
        assert server.process.wait(timeout=60) == 1, server.log_tail()
        assert "resformer-serve: error: the continuous-batching worker died" in server.log_tail()
    finally:
        server.close()


@pytest.mark.parametrize(("name", "flags"), [("svformer", CB_FLAGS), ("llama", CB_FLAGS), ("learnable_plus", ())])
def test_sigterm_stops_a_server_and_says_what_it_did(folders, tmp_path, name, flags):
    """After serving, SIGTERM ends the process (status 143) without a SIGKILL (transformers' server leaves its
    batching thread, not a daemon, running after it stops, and the process with it), and its last line says how many
    requests it answered (issue 68: it said "nothing was done")."""
    server = Server(folders[name], tmp_path / "stopping.log", *flags)
    try:
        assert server.complete(PROMPTS[1])[1] == MAX_TOKENS
        assert server.chat(PROMPTS[2])[1] > 0
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 143, server.log_tail()
        last = server.log_tail().strip().splitlines()[-1]
        assert last == "resformer-serve: terminated; the server stopped after answering 2 generation requests", last
    finally:
        server.close()


#: Run in the server's process before the command: SIGTERM arrives while the server loads the model.
SIGTERM_WHILE_LOADING = """
import os, signal
from transformers.cli.serving import model_manager

load = model_manager.ModelManager.load_model_and_processor

def loading(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return load(self, *args, **kwargs)

model_manager.ModelManager.load_model_and_processor = loading
"""


def test_sigterm_while_the_model_loads_says_no_request_was_answered(folders, tmp_path):
    folder = str(folders["svformer"])
    script = f"{SIGTERM_WHILE_LOADING}\nfrom resformer_hf.cli.serve import main\nraise SystemExit(main([{folder!r}]))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"resformer-serve: terminated; stopped while loading {folder}; no request was answered")
