"""Issue 11, one error contract for `resformer-convert`, `resformer-quickstart` and `resformer-analyze`: every bad
input is one line `<prog>: error: ...` with exit status 2, the environment's refusals one line with status 1,
Ctrl-C (start-up included) one line with 130, SIGTERM one line with 143, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from resformer_hf.cli.analyze import main as analyze_main
from resformer_hf.cli.convert import main as convert_main
from resformer_hf.cli.quickstart import main as quickstart_main
from resformer_hf.text import sample_text, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MAINS = {"resformer-convert": convert_main, "resformer-quickstart": quickstart_main, "resformer-analyze": analyze_main}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("src") / "llama"
    LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).save_pretrained(directory, max_shard_size="24KB")
    return directory


@pytest.fixture(scope="module")
def analysis_inputs(tmp_path_factory) -> dict[str, Path]:
    """A model with a 300-token tokenizer, a model whose vocabulary (160) is smaller than it, and text files."""
    root = tmp_path_factory.mktemp("analysis")
    tokenizer = train_tokenizer([sample_text(20_000)], 300)
    torch.manual_seed(0)
    for name, vocab in (("fits", len(tokenizer)), ("small-vocab", SMALL["vocab_size"])):
        LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": vocab})).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "text.txt").write_text(sample_text(2_000))
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "nul.txt").write_bytes(b"text\x00with a NUL byte " * 10)
    (root / "empty.txt").write_text(" \n")
    return {"root": root, **{p.stem: p for p in root.iterdir()}}


def error_lines(stderr: str) -> list[str]:
    """stderr without progress bars (loading weights shows one; it is progress, not an error)."""
    return [line for line in stderr.strip().splitlines() if not re.search(r"\|.*\d+/\d+ \[", line)]


def assert_one_line(capsys, prog: str, code: int, words: str = "") -> str:
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: ") and words in err[0], err[0]
    return err[0]


# ---- malformed checkpoints -------------------------------------------------------------------------------------


def _edit_json(path: Path, key: str, value) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "file, key, value, words",
    [
        ("config.json", "architectures", [5], "architectures=[5] must be a list of class names"),
        ("config.json", "vocab_size", None, "vocab_size=None must be a positive integer"),
        ("config.json", "hidden_size", "32", "hidden_size='32' must be a positive integer"),
        ("config.json", "rms_norm_eps", "tiny", "config.json does not parse as a llama config"),
        ("config.json", "hidden_act", "no-such-activation", "describes a model that cannot be built"),
        ("model.safetensors.index.json", "weight_map", ["model-00001-of-00008.safetensors"],
         "weight_map must map tensor names to shard file names"),
    ],
)
def test_malformed_config_values_are_one_line(llama, tmp_path, capsys, file, key, value, words):
    src = shutil.copytree(llama, tmp_path / "src")
    _edit_json(src / file, key, value)
    assert convert_main([str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
    assert_one_line(capsys, "resformer-convert", 2, words)
    assert not (tmp_path / "dst").exists()


# ---- destination names -------------------------------------------------------------------------------------------


def test_a_long_but_legal_dst_name_converts(llama, tmp_path):
    dst = tmp_path / ("d" * 240)  # legal (255 is the limit) even though staging names add a suffix
    assert convert_main([str(llama), str(dst), "--no-progress"]) == 0
    assert (dst / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [dst.name]


def test_a_too_long_dst_name_is_one_line(llama, tmp_path, capsys):
    assert convert_main([str(llama), str(tmp_path / ("d" * 300)), "--no-progress"]) == 2
    assert_one_line(capsys, "resformer-convert", 2, "name is 300 bytes long; the file system allows 255")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_symlinked_dst_is_refused_and_untouched(llama, tmp_path, capsys, overwrite):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(target)
    argv = [str(llama), str(tmp_path / "link"), "--no-progress"] + (["--overwrite"] if overwrite else [])
    assert convert_main(argv) == 2
    assert_one_line(capsys, "resformer-convert", 2, "is a symbolic link")
    assert (tmp_path / "link").is_symlink() and [p.name for p in target.iterdir()] == ["keep.txt"]


# ---- analysis inputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, text, words",
    [
        ("fits", "binary", "is not UTF-8 text"),
        ("fits", "nul", "holds NUL bytes"),
        ("fits", "empty", "is empty"),
        ("fits", "root", "is not a file"),  # a folder where a file is expected
        ("small-vocab", "text", "has only vocab_size=160"),
    ],
)
def test_analyze_bad_inputs_are_one_line(analysis_inputs, tmp_path, capsys, model, text, words):
    argv = [str(analysis_inputs[model]), "--text", str(analysis_inputs[text]), "--out", str(tmp_path / "out"),
            "--no-plots"]
    assert analyze_main(argv) == 2
    assert_one_line(capsys, "resformer-analyze", 2, words)
    assert not (tmp_path / "out").exists()


def test_analyze_unreadable_text_is_one_line(analysis_inputs, tmp_path, capsys, monkeypatch):
    """Permission denied (simulated: the suite may run as root, which reads anything)."""
    real = pathlib.Path.open

    def denied(self, *args, **kwargs):
        if self.name == "text.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", denied)
    argv = [str(analysis_inputs["fits"]), "--text", str(analysis_inputs["text"]), "--out", str(tmp_path / "o")]
    assert analyze_main(argv) == 2
    assert_one_line(capsys, "resformer-analyze", 2, "cannot be read (Permission denied)")


def test_environment_errors_are_one_line_with_status_1(analysis_inputs, tmp_path, capsys, monkeypatch):
    """A full disk while writing the report: one line naming the file, status 1, no traceback."""
    real = pathlib.Path.write_text

    def disk_full(self, *args, **kwargs):
        if self.name == "summary.md":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    out = tmp_path / "out"
    argv = [str(analysis_inputs["fits"]), "--text", str(analysis_inputs["text"]), "--out", str(out), "--no-plots",
            "--max-tokens", "16", "--num-sequences", "1"]
    assert analyze_main(argv) == 1
    err = error_lines(capsys.readouterr().err)
    assert err == [f"resformer-analyze: error: No space left on device ({out / 'summary.md'})"]


# ---- flags -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prog, argv, words",
    [
        ("resformer-quickstart", ["--seed", "-1"], "--seed: -1 must be between 0 and 4294967295"),
        ("resformer-quickstart", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ("resformer-convert", ["src", "dst", "--variant", "bogus"], "--variant: invalid choice: 'bogus'"),
        ("resformer-convert", ["src-only"], "the following arguments are required: DST"),
        ("resformer-analyze", ["model"], "the following arguments are required: --text, --out"),
        ("resformer-analyze", ["m", "--text", "t", "--out", "o", "--max-tokens", "1"], "1 must be at least 2"),
    ],
)
def test_usage_errors_are_one_line(capsys, prog, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        MAINS[prog](argv)
    assert exit_info.value.code == 2
    assert_one_line(capsys, prog, 2, words)


# ---- interrupts, in real processes -------------------------------------------------------------------------------

#: Run as `python -c SCRIPT SIGNAL PROG ARGS...`: PROG's main, with SIGNAL (INT or TERM) sent to the process when it
#: first imports transformers, mid start-up (torch is loaded, transformers not yet).
_SIGNAL_WHILE_IMPORTING = textwrap.dedent(
    """
    import importlib.abc, os, signal, sys

    class SignalOnImport(importlib.abc.MetaPathFinder):
        sent = False

        def find_spec(self, name, path=None, target=None):
            if name == "transformers" and not self.sent:
                self.sent = True
                os.kill(os.getpid(), SIGNAL)
            return None

    SIGNAL = getattr(signal, "SIG" + sys.argv.pop(1))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if our parent ignores Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a supervisor starts a process
    sys.argv = sys.argv[1:]  # argv[0] is the command's name, as for the installed console script
    sys.meta_path.insert(0, SignalOnImport())
    import importlib
    sys.exit(importlib.import_module("resformer_hf.cli." + sys.argv[0].split("-")[1]).main())
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "word", "status"), [("INT", "interrupted", 130), ("TERM", "terminated", 143)])
@pytest.mark.parametrize("prog", ["resformer-convert", "resformer-quickstart", "resformer-analyze", "resformer-serve"])
def test_a_signal_during_start_up_is_one_line(tmp_path, prog, sig, word, status):
    """Ctrl-C (130) and SIGTERM (143, issue 68: it was a silent exit) while the command imports torch and
    transformers: one line saying nothing was done, nothing on stdout."""
    result = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_IMPORTING, sig, prog, "--help"], env=_env(),
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == status, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"{prog}: {word} while starting; nothing was done"]
    assert result.stdout == ""


@pytest.mark.slow
def test_sigterm_while_the_converter_starts_leaves_nothing_behind(llama, tmp_path):
    """A real conversion's command line, SIGTERM'd during its start-up: its one line, status 143, and no DST, staging
    directory or other file beside where DST would be."""
    result = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_IMPORTING, "TERM", "resformer-convert", str(llama),
                             str(tmp_path / "out")], env=_env(), capture_output=True, text=True, timeout=240,
                            cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (
        143, ["resformer-convert: terminated while starting; nothing was done"]), result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
