"""`resformer-serve` in a child process, and `generate()` on the same folder as its reference: shared by the tests of
the server (test_serving_hf.py, test_serving_sampling.py). Import only where `transformers serve` is available."""

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
from pathlib import Path

import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from resformer_hf import ResFormerConfig
from resformer_hf.examples.finetune import TEXT_CHARS, VOCAB_SIZE
from resformer_hf.hub import save_for_hub
from resformer_hf.text import sample_text, train_tokenizer

from helpers import TINY, model_with_random_lambdas

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


def write_folders(root: Path) -> dict[str, Path]:
    """Plugin-written Hub folders (λ moved off their initial values) and a Llama control, all with a tokenizer
    that has a chat template."""
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
    torch.manual_seed(3)  # value embeddings (issue 56): learnable_plus with random tables and gates in layers 1, 3
    model = model_with_random_lambdas(ResFormerConfig(**shape, value_residual="learnable_plus",
                                                      value_embeddings="alternating"))
    with torch.no_grad():
        for parameter in (p for name, p in model.named_parameters() if ".value_embedding" in name):
            parameter.normal_(0.0, 0.5)
    folders["value_embeddings"] = root / "value_embeddings"
    save_for_hub(model, folders["value_embeddings"], tokenizer=tokenizer)
    torch.manual_seed(2)
    folders["llama"] = root / "llama"
    LlamaForCausalLM(LlamaConfig(**shape)).eval().save_pretrained(folders["llama"])
    tokenizer.save_pretrained(folders["llama"])
    return folders


class Server:
    """`resformer-serve FOLDER --host 127.0.0.1 --port P ...` in a child process, stopped on `close()`."""

    def __init__(self, folder: Path, log: Path, *flags: str, prelude: str = "") -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        arguments = [str(folder), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype",
                     "float32", *flags]
        command = [sys.executable, "-m", "resformer_hf.cli.serve", *arguments]
        if prelude:  # code run before the command, in the server's process (fault injection)
            command = [sys.executable, "-c", f"{prelude}\nimport sys\nfrom resformer_hf.cli.serve import main\n"
                       f"sys.exit(main({arguments!r}))"]
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
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def post(self, path: str, body: dict | bytes) -> tuple[int, bytes]:
        status, _, raw = self.exchange(path, body)
        return status, raw

    def exchange(self, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        """(status, headers with lower-case names, body) of a POST with `headers` added."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    def complete(self, prompt: str | list[int], stream: bool = False) -> tuple[str, int]:
        """(text, completion tokens) of a greedy /v1/completions request."""
        return self._text("/v1/completions", {"prompt": prompt}, stream)

    def chat(self, content: str, stream: bool = False) -> tuple[str, int]:
        return self._text("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}, stream)

    def _text(self, path: str, body: dict, stream: bool) -> tuple[str, int]:
        (text, tokens), = self.choices(path, body, stream)[0]
        return text, tokens

    def choices(self, path: str, body: dict, stream: bool) -> tuple[list[tuple[str, int]], dict]:
        """Every choice of a request (greedy unless `body` sets a temperature) as (text, completion tokens) in index
        order, and the usage."""
        status, raw = self.post(path, {"max_tokens": MAX_TOKENS, "temperature": 0, **body, "stream": stream})
        assert status == 200, (status, raw, self.log_tail())
        return read_choices(path, raw, stream)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def served(folders: dict[str, Path], tmp_path_factory, name: str, *flags: str):
    """A module fixture's body: `folders[name]` served with `flags`, and its reference; the server is stopped after."""
    server = Server(folders[name], tmp_path_factory.mktemp("logs") / f"{name}.log", *flags)
    try:
        yield server, Reference(folders[name])
    finally:
        server.close()
        assert server.process.poll() is not None


class Reference:
    """`generate()`'s text and token count for the folder, with the plugin's classes: greedy, or with a `seed` what
    OpenAI's temperature 1 draws (the whole distribution) after `torch.manual_seed(seed)`."""

    def __init__(self, folder: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def _generate(self, input_ids: list[int], stream: bool, seed: int | None = None) -> tuple[str, int]:
        sampling = {"do_sample": False}
        if seed is not None:
            torch.manual_seed(seed)
            sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
        output = self.model.generate(torch.tensor([input_ids]), max_new_tokens=MAX_TOKENS, **sampling)
        new = output[0, len(input_ids):].tolist()
        if not stream:
            return self.tokenizer.decode(new, skip_special_tokens=True), len(new)
        # A stream sends text as tokens complete characters (tokenizers' DecodeStream, as the server's streamer
        # does), so a byte-level character cut off by max_tokens is never sent, where decode() ends in U+FFFD.
        decoder = DecodeStream([], skip_special_tokens=True)
        pieces = [decoder.step(self.tokenizer.backend_tokenizer, token) for token in new]
        return "".join(piece for piece in pieces if piece is not None), len(new)

    def complete(self, prompt: str | list[int], stream: bool = False, seed: int | None = None) -> tuple[str, int]:
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        return self._generate(ids, stream, seed)

    def chat(self, content: str, stream: bool = False, seed: int | None = None) -> tuple[str, int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return self._generate(list(ids), stream, seed)


def read_choices(path: str, raw: bytes, stream: bool) -> tuple[list[tuple[str, int]], dict]:
    """Every choice of an answer from `path` as (text, completion tokens) in index order, and the usage; the answer
    (every chunk of a stream) has one id."""
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"] if stream else [json.loads(raw)]
    assert not any("error" in chunk for chunk in chunks), chunks
    assert len({chunk["id"] for chunk in chunks}) == 1, chunks  # one request, one id
    key = "text" if path == "/v1/completions" else ("delta" if stream else "message")
    pieces: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            piece = choice[key] if key == "text" else (choice.get(key) or {}).get("content") or ""
            pieces.setdefault(choice["index"], []).append(piece)
    usages = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert sorted(pieces) == list(range(len(pieces))), sorted(pieces)
    if len(pieces) == 1:
        return [("".join(pieces[0]), usages[-1]["completion_tokens"])], usages[-1]
    # several choices: the usage is the request's (one final chunk when streaming), tokens per choice unknown
    assert len(usages) == 1, usages
    return [("".join(pieces[index]), None) for index in sorted(pieces)], usages[0]
