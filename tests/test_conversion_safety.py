"""Issue 11, converter and quickstart outputs: nothing of the user's is lost, no opt-in is bypassed, no silent NaN.

Each test drives the command as a user would (its `main`, in-process unless a real signal is needed) and asserts the
exact outcome: exit status, the one-line message, which files exist afterwards and their modes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import resformer_hf.hub.model_card as model_card
from resformer_hf.cli.convert import main as convert_main
from resformer_hf.cli.quickstart import main as quickstart_main
from resformer_hf.text import sample_text, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(directory: Path, dtype: torch.dtype = torch.float32, edit=None, **save_kwargs) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(dtype)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(directory, **save_kwargs)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("src") / "llama")


def tree(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def one_error_line(capsys, prog: str = "resformer-convert") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def _on_card(monkeypatch, action) -> None:
    """Run `action()` once, while the conversion is mid-run (weights staged, card being written)."""
    real, done = model_card.write_model_card, []

    def write_then_act(*args, **kwargs):
        path = real(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return path

    monkeypatch.setattr(model_card, "write_model_card", write_then_act)


# ---- data loss -------------------------------------------------------------------------------------------------


def test_files_appearing_in_dst_during_the_run_are_kept(llama, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "dst"

    def user_writes_into_dst():
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")

    _on_card(monkeypatch, user_writes_into_dst)
    assert convert_main([str(llama), str(dst), "--no-progress"]) == 2
    assert "received files while the output was being written" in one_error_line(capsys)
    assert tree(dst) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    (kept,) = tmp_path.glob("dst.new-*")  # the finished output, beside DST and named in the message
    assert (kept / "config.json").is_file() and not list(tmp_path.glob(".dst.*"))


def test_two_conversions_to_one_dst_never_replace_each_other(llama, tmp_path, monkeypatch, capsys):
    """The second conversion starts and finishes while the first is mid-run: the first must not replace it."""
    from resformer_hf import convert_llama_checkpoint

    dst = tmp_path / "dst"
    _on_card(monkeypatch, lambda: convert_llama_checkpoint(llama, dst, variant="learnable_plus", progress=False))
    assert convert_main([str(llama), str(dst), "--variant", "learnable", "--no-progress"]) == 2
    one_error_line(capsys)
    assert json.loads((dst / "config.json").read_text())["value_residual"] == "learnable_plus"
    (kept,) = tmp_path.glob("dst.new-*")
    assert json.loads((kept / "config.json").read_text())["value_residual"] == "learnable"


@pytest.mark.parametrize("target", ["", ".", "~"])
def test_overwrite_refuses_empty_current_and_home_directories(llama, tmp_path, monkeypatch, capsys, target):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    for folder in (cwd, home):
        folder.mkdir()
        (folder / "precious.txt").write_text("keep me")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    assert convert_main([str(llama), target, "--overwrite", "--no-progress"]) == 2
    message = one_error_line(capsys)
    assert ("is empty" in message) if target == "" else ("current directory" in message or "home" in message)
    for folder in (cwd, home):
        assert sorted(p.name for p in folder.iterdir()) == ["precious.txt"]


def test_output_paths_that_would_delete_more_than_an_output_are_refused(tmp_path, monkeypatch):
    """The check itself, for every protected place (the file-system root only ever here: never with a real run)."""
    from resformer_hf.conversion.staging import OutputPathError, check_output_path

    home = tmp_path / "users" / "me"
    home.mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(home))
    for path, words in (("", "is empty"), ("/", "root of the file system"), (".", "is the current directory"),
                        ("..", "is the current directory or contains it"), ("~", "is your home folder"),
                        ("~/..", "is your home folder or contains it")):
        with pytest.raises(OutputPathError, match=words):
            check_output_path(path, label="DST", replace=True, replace_hint="pass --overwrite")
    assert check_output_path("new", label="DST", replace=True, replace_hint="") == tmp_path / "cwd" / "new"


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory) -> Path:
    """A tiny Llama with its own tokenizer, as a user's --model would be."""
    directory = tmp_path_factory.mktemp("qs") / "model"
    tokenizer = train_tokenizer([sample_text(20_000)], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": len(tokenizer)})).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("layout", ["output-holds-model", "output-is-model", "output-holds-data",
                                    "output-holds-tokenizer", "output-is-current-directory", "output-empty"])
def test_quickstart_overwrite_never_deletes_its_inputs(quickstart_model, tmp_path, monkeypatch, capsys, layout):
    """Refused before any work, so the user's model, tokenizer and data stay, whatever --overwrite says."""
    out = tmp_path / "out"
    model = out / "model" if layout == "output-holds-model" else out if layout == "output-is-model" else (
        tmp_path / "model")
    shutil.copytree(quickstart_model, model)
    data = (out if layout == "output-holds-data" else tmp_path) / "text.txt"
    data.parent.mkdir(exist_ok=True)
    data.write_text(sample_text(20_000))
    argv = ["--model", str(model), "--data", str(data), "--output", str(out), "--overwrite", "--steps", "1",
            "--batch-size", "2", "--block-size", "32", "--max-new-tokens", "2"]  # a run that would get to writing
    if layout == "output-holds-tokenizer":
        shutil.copytree(quickstart_model, out / "tok")
        argv += ["--tokenizer", str(out / "tok")]
    if layout in ("output-is-current-directory", "output-empty"):
        out.mkdir(exist_ok=True)
        (out / "precious.txt").write_text("keep me")
        monkeypatch.chdir(out)
        argv[argv.index("--output") + 1] = "" if layout == "output-empty" else "."
    before = tree(tmp_path)
    assert quickstart_main(argv) == 2
    one_error_line(capsys, "resformer-quickstart")
    assert tree(tmp_path) == before


# ---- security --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_safetensors_index_naming_a_pickle_never_unpickles(llama, tmp_path, monkeypatch, capsys, allow_pickle):
    src = shutil.copytree(llama, tmp_path / "src")
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, "pytorch_model.bin")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    argv = [str(src), str(tmp_path / "dst"), "--no-progress"] + (["--allow-pickle"] if allow_pickle else [])
    assert convert_main(argv) == 2
    assert "'pytorch_model.bin', which is not a .safetensors file" in one_error_line(capsys)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("reference", ["relative", "absolute"])
def test_index_entries_outside_src_are_refused(tmp_path, capsys, reference):
    src = _llama(tmp_path / "src", max_shard_size="24KB")
    other = tmp_path / "other-model"
    other.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.move(src / first, other / first)
    outside = f"../other-model/{first}" if reference == "relative" else str(other / first)
    index["weight_map"] = {name: outside if shard == first else shard for name, shard in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert convert_main([str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
    assert f"names the shard {outside!r}, which is not a file name inside SRC" in one_error_line(capsys)
    assert not (tmp_path / "dst").exists()


@contextlib.contextmanager
def _address_space_limit(extra: int):
    """Cap this process's address space at its current size plus `extra` bytes for the duration of the block."""
    import resource

    size = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_config_sizes_are_bounded_by_the_weights_before_anything_is_built(llama, tmp_path, monkeypatch, capsys):
    src = shutil.copytree(llama, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    import transformers

    def nothing_built(*args, **kwargs):
        raise AssertionError("a config was parsed before its sizes were checked against the weights")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", nothing_built)
    with _address_space_limit(extra=2 << 30):  # a regression fails with MemoryError instead of exhausting the machine
        assert convert_main([str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
    assert "num_hidden_layers=1000000000 but the weights hold 3 layer(s) (0..2)" in one_error_line(capsys)


# ---- interrupted runs and what they leave --------------------------------------------------------------------------


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_rerun_removes_partials_of_dead_runs_and_names_the_others(llama, tmp_path, capsys):
    dst = tmp_path / "dst"
    stale, busy, foreign = (tmp_path / f".dst.partial-{name}" for name in ("1-aaaaaa", "2-bbbbbb", "x1y2z3"))
    for folder, pid in ((stale, _dead_pid()), (busy, os.getpid()), (foreign, None)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * 1024)
        if pid is not None:
            (folder / ".staging-owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert convert_main([str(llama), str(dst), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert not stale.exists() and busy.exists() and foreign.exists()
    log = " ".join((captured.out + captured.err).split())
    assert "removed 1 unfinished output(s) of killed conversions: .dst.partial-1-aaaaaa" in log
    assert str(busy) in log and str(foreign) in log
    assert (dst / "config.json").is_file()


_STOP_WHEN_STAGED = textwrap.dedent(
    """
    import logging, pathlib, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if our parent ignores Ctrl-C
    for name in ("torchao", "torch.utils._pytree"):  # as the command's start-up does (cli/startup.py)
        logging.getLogger(name).setLevel(logging.ERROR)
    import resformer_hf.hub.model_card as model_card

    real = model_card.write_model_card
    def write_then_wait(*args, **kwargs):
        path = real(*args, **kwargs)
        pathlib.Path(sys.argv[1]).touch()  # the weights are staged: the conversion is mid-run
        time.sleep(120)
        return path
    model_card.write_model_card = write_then_wait
    from resformer_hf.cli.convert import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_conversion_leaves_nothing_behind(llama, tmp_path, capsys, sig):
    """Ctrl-C and SIGTERM clean up and say so in one line; after a SIGKILL the next run to the same DST does."""
    before = tree(llama)
    flag, dst = tmp_path / "staged", tmp_path / "dst"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", _STOP_WHEN_STAGED, str(flag), str(llama), str(dst),
                                "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not flag.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (staging,) = tmp_path.glob(".dst.partial-*")
        assert list(staging.glob("*.safetensors"))  # really mid-run
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert tree(llama) == before and not dst.exists()
    if sig == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL and staging.exists()
        assert convert_main([str(llama), str(dst), "--no-progress"]) == 0
        assert f"removed 1 unfinished output(s) of killed conversions: {staging.name}" in capsys.readouterr().out
    else:
        word, status = ("interrupted", 130) if sig == signal.SIGINT else ("terminated", 143)
        assert process.returncode == status
        assert err.strip().splitlines() == [f"resformer-convert: {word}; nothing was written to {dst}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["dst", "staged"] if sig == signal.SIGKILL else ["staged"])


def test_dst_honours_the_umask_and_keeps_an_existing_folders_mode(llama, tmp_path):
    previous = os.umask(0o022)
    try:
        assert convert_main([str(llama), str(tmp_path / "new"), "--no-progress"]) == 0
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o2775)
        assert convert_main([str(llama), str(shared), "--no-progress"]) == 0
        private = tmp_path / "private"
        private.mkdir()
        (private / "old.txt").write_text("old")
        os.chmod(private, 0o750)
        assert convert_main([str(llama), str(private), "--overwrite", "--no-progress"]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o755
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2775
    assert stat.S_IMODE(private.stat().st_mode) == 0o750 and not (private / "old.txt").exists()
    assert stat.S_IMODE((tmp_path / "new" / "model.safetensors").stat().st_mode) == 0o644


# ---- nothing non-finite passes ---------------------------------------------------------------------------------


def test_verify_fails_on_nan(tmp_path, capsys):
    def poison(model):
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")

    src = _llama(tmp_path / "src", edit=poison)
    capsys.readouterr()
    assert convert_main([str(src), str(tmp_path / "dst"), "--verify", "--no-progress"]) == 2
    assert "hold NaN or infinity, e.g. model.layers.1.mlp.up_proj.weight" in one_error_line(capsys)
    assert not (tmp_path / "dst").exists()
    # Without --verify the conversion stays a faithful copy: the NaN is carried over, not hidden.
    assert convert_main([str(src), str(tmp_path / "copy"), "--no-progress"]) == 0
    weight = load_file(tmp_path / "copy" / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    assert weight[0, 0].isnan() and weight.isnan().sum() == 1


def test_float16_cast_refuses_values_beyond_its_range(tmp_path, capsys):
    def too_large(model):
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e5  # float16 tops out at 65504

    src = _llama(tmp_path / "src", dtype=torch.bfloat16, edit=too_large)
    capsys.readouterr()
    assert convert_main([str(src), str(tmp_path / "dst"), "--dtype", "float16", "--no-progress"]) == 2
    message = one_error_line(capsys)
    assert "model.layers.0.mlp.up_proj.weight holds 9.984e+04, beyond what float16 can represent" in message
    assert not (tmp_path / "dst").exists()
    assert convert_main([str(src), str(tmp_path / "bf16"), "--verify", "--no-progress"]) == 0  # the source dtype fits
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert converted.model.layers[0].mlp.up_proj.weight[0, 0].item() == pytest.approx(1e5, rel=1e-2)
