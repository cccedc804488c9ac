"""`resformer-serve`: Hugging Face's own OpenAI-compatible server (`transformers serve`) on a ResFormer folder.

Each server runs in its own process on 127.0.0.1 and is stopped by the test module (SIGTERM, then SIGKILL). Its
greedy text is compared with `generate()` in this process on the same folder (text and token count), for
/v1/completions and /v1/chat/completions, streaming and not, for 8 concurrent requests, with and without
`--continuous-batching`; a Llama folder of the same shape served the same way is the control. Bad requests get a 4xx
with a message, and the next request is served.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers.utils.import_utils import is_serve_available

if not is_serve_available():
    pytest.skip("transformers serve needs FastAPI, uvicorn and openai: pip install -e '.[serve]'",
                allow_module_level=True)

import torch  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from resformer_hf import ResFormerConfig  # noqa: E402
from resformer_hf.examples.finetune import TEXT_CHARS, VOCAB_SIZE  # noqa: E402
from resformer_hf.hub import save_for_hub  # noqa: E402
from resformer_hf.text import sample_text, train_tokenizer  # noqa: E402

from helpers import TINY, model_with_random_lambdas  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
START_TIMEOUT_S = 300  # a loaded 2-core machine imports torch + transformers slowly
REQUEST_TIMEOUT_S = 120
CONCURRENT = 8
PROMPTS = ("It", "The quick brown fox", "Once upon a time there was a little girl who lived in a village near",
           sample_text(400)[:160])
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
#: A paged cache of an explicit size (on CPU, transformers would size it from the machine's memory).
CB_FLAGS = ("--continuous-batching", "--cb-num-blocks", "16", "--cb-max-batch-tokens", "256")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Plugin-written Hub folders (λ moved off their initial values) and a Llama control, all with a tokenizer
    that has a chat template."""
    root = tmp_path_factory.mktemp("hf-serving")
    tokenizer = train_tokenizer([sample_text(TEXT_CHARS)], VOCAB_SIZE)
    tokenizer.chat_template = CHAT_TEMPLATE
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    shape = {**TINY, **special, "vocab_size": len(tokenizer), "max_position_embeddings": 128}
    folders = {}
    for seed, variant in enumerate(("learnable_plus", "svformer", "gated")):
        torch.manual_seed(seed)
        model = model_with_random_lambdas(ResFormerConfig(**shape, value_residual=variant))
        folders[variant] = root / variant
        save_for_hub(model, folders[variant], tokenizer=tokenizer)
    torch.manual_seed(2)
    folders["llama"] = root / "llama"
    LlamaForCausalLM(LlamaConfig(**shape)).eval().save_pretrained(folders["llama"])
    tokenizer.save_pretrained(folders["llama"])
    return folders


class Server:
    """`resformer-serve FOLDER --host 127.0.0.1 --port P ...` in a child process, stopped on `close()`."""

    def __init__(self, folder: Path, log: Path, *flags: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "resformer_hf.cli.serve", str(folder), "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", "cpu", "--dtype", "float32", *flags]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        self.close()
        raise AssertionError(f"server not up after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            return response.status, response.read()

    def post(self, path: str, body: dict | bytes) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def complete(self, prompt: str, stream: bool = False) -> tuple[str, int]:
        """(text, completion tokens) of a greedy /v1/completions request."""
        return self._text("/v1/completions", {"prompt": prompt}, stream)

    def chat(self, content: str, stream: bool = False) -> tuple[str, int]:
        return self._text("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}, stream)

    def _text(self, path: str, body: dict, stream: bool) -> tuple[str, int]:
        status, raw = self.post(path, {**body, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
        assert status == 200, (status, raw, self.log_tail())
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"] if stream else [json.loads(raw)]
        assert not any("error" in chunk for chunk in chunks), chunks
        key = "text" if path == "/v1/completions" else ("delta" if stream else "message")
        pieces = [choice[key] if key == "text" else (choice.get(key) or {}).get("content") or ""
                  for chunk in chunks for choice in chunk.get("choices", [])]
        usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
        return "".join(pieces), usage[-1]["completion_tokens"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


class Reference:
    """`generate()`'s greedy text and token count for the folder, with the plugin's classes."""

    def __init__(self, folder: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def _generate(self, input_ids: list[int], stream: bool) -> tuple[str, int]:
        output = self.model.generate(torch.tensor([input_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        new = output[0, len(input_ids):].tolist()
        if not stream:
            return self.tokenizer.decode(new, skip_special_tokens=True), len(new)
        # A stream sends text as tokens complete characters (tokenizers' DecodeStream, as the server's streamer
        # does), so a byte-level character cut off by max_tokens is never sent, where decode() ends in U+FFFD.
        decoder = DecodeStream([], skip_special_tokens=True)
        pieces = [decoder.step(self.tokenizer.backend_tokenizer, token) for token in new]
        return "".join(piece for piece in pieces if piece is not None), len(new)

    def complete(self, prompt: str, stream: bool = False) -> tuple[str, int]:
        return self._generate(self.tokenizer(prompt)["input_ids"], stream)

    def chat(self, content: str, stream: bool = False) -> tuple[str, int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return self._generate(list(ids), stream)


def _serve(folders, tmp_path_factory, name: str, *flags: str):
    server = Server(folders[name], tmp_path_factory.mktemp("logs") / f"{name}.log", *flags)
    try:
        yield server, Reference(folders[name])
    finally:
        server.close()
        assert server.process.poll() is not None


@pytest.fixture(scope="module")
def plain(folders, tmp_path_factory):
    """learnable_plus served with `model.generate()` per request."""
    yield from _serve(folders, tmp_path_factory, "learnable_plus")


@pytest.fixture(scope="module")
def batched(folders, tmp_path_factory):
    """SVFormer served with continuous batching."""
    yield from _serve(folders, tmp_path_factory, "svformer", *CB_FLAGS)


@pytest.fixture(scope="module")
def gated(folders, tmp_path_factory):
    """`gated` (random value gates) served with continuous batching."""
    yield from _serve(folders, tmp_path_factory, "gated", *CB_FLAGS)


@pytest.fixture(scope="module")
def control(folders, tmp_path_factory):
    """The Llama control, with continuous batching."""
    yield from _serve(folders, tmp_path_factory, "llama", *CB_FLAGS)


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


@pytest.mark.parametrize("fixture", ["plain", "batched", "gated", "control"])
def test_concurrent_requests_equal_generate(fixture, request):
    server, reference = request.getfixturevalue(fixture)
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(CONCURRENT)]
    expected = [reference.complete(prompt, stream=index % 2 == 1) for index, prompt in enumerate(prompts)]
    assert len({reference.complete(prompt) for prompt in PROMPTS}) == len(PROMPTS)  # not one continuation for all
    assert _concurrently(server, prompts) == expected
    if fixture == "batched":
        assert server.chat(PROMPTS[2], stream=True) == reference.chat(PROMPTS[2], stream=True)


@pytest.mark.parametrize("fixture", ["plain", "batched"])
def test_bad_requests_get_a_4xx_with_a_message_and_the_next_is_served(fixture, request):
    server, reference = request.getfixturevalue(fixture)
    too_long = " ".join(["the quick brown fox"] * 100)
    bad = {
        "malformed JSON": (b'{"prompt": "It", "max_tokens": ', 422, "JSON decode error"),
        "prompt beyond the context": ({"prompt": too_long, "max_tokens": 4}, 400, "context is 128 tokens"),
        "negative max_tokens": ({"prompt": "It", "max_tokens": -1}, 400, "max_tokens must be a positive integer"),
        "prompt + max_tokens beyond the context": ({"prompt": "It", "max_tokens": 500}, 400, "lower max_tokens"),
    }
    expected = reference.complete(PROMPTS[1])
    for what, (body, status, message) in bad.items():
        got_status, raw = server.post("/v1/completions", body)
        assert (got_status, message in raw.decode()) == (status, True), (what, got_status, raw)
        assert server.complete(PROMPTS[1]) == expected, what
    got_status, raw = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]})
    assert got_status == 400 and "shorten the prompt" in raw.decode(), raw
    assert server.get("/health")[0] == 200
