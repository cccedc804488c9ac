"""`resformer-serve`'s bad input follows the commands' contract (one line `resformer-serve: error: ...`, status 2),
before any server starts, and plain `transformers serve` fails on a ResFormer folder as docs/serving.md says; the
server itself is tested in test_serving_hf.py."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils.import_utils import is_serve_available

from resformer_hf import ResFormerForCausalLM
from resformer_hf.cli.serve import main
from resformer_hf.hub import save_for_hub
from resformer_hf.text import train_tokenizer

from helpers import tiny_config


def _error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    status = main(argv)
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda tmp: tmp / "missing", "no folder"),
        (lambda tmp: tmp / "deep" / "er" / "missing", "no folder"),
        (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "is a file"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "has no config.json"),
    ],
)
def test_bad_folder_is_one_line_and_status_2(tmp_path, capsys, make, words):
    status, err = _error(capsys, [str(make(tmp_path))])
    assert status == 2 and len(err) == 1 and err[0].startswith("resformer-serve: error: ") and words in err[0], err


def test_missing_folder_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "the following arguments are required: FOLDER" in capsys.readouterr().err


@pytest.mark.skipif(not is_serve_available(), reason="needs transformers serve's deps: pip install -e '.[serve]'")
@pytest.mark.parametrize("flags, words", [(["--no-such-flag"], "No such option: --no-such-flag"),
                                          (["--port", "abc"], "Invalid value for '--port'")])
def test_bad_server_option_is_one_line_and_status_2(tmp_path, capsys, flags, words):
    (tmp_path / "config.json").write_text("{}")
    status, err = _error(capsys, [str(tmp_path), *flags])
    assert status == 2 and len(err) == 1 and err[0].startswith("resformer-serve: error: ") and words in err[0], err


def test_console_script_and_extra_are_declared():
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert "resformer-serve = resformer_hf.cli.serve:main" in setup["options.entry_points"]["console_scripts"]
    assert "transformers[serving]" in setup["options.extras_require"]["serve"]


#: What docs/serving.md quotes of plain `transformers serve FOLDER`: without and with `--trust-remote-code`.
PLAIN_SERVE_DIES = {(): "contains custom code which must be executed to correctly load the model",
                    ("--trust-remote-code",): "module transformers has no attribute ResFormerForCausalLM"}


@pytest.mark.slow
@pytest.mark.skipif(not is_serve_available(), reason="needs transformers serve's deps: pip install -e '.[serve]'")
@pytest.mark.parametrize("flags", list(PLAIN_SERVE_DIES), ids=["no-flag", "trust-remote-code"])
def test_plain_transformers_serve_dies_as_serving_md_says(tmp_path, flags):
    """Why `resformer-serve` exists (issue 68: the page said both forms die on the class lookup): without the flag
    the folder's custom code stops it first; with it, the class lookup does."""
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog " * 50], 300)
    model = ResFormerForCausalLM(tiny_config(vocab_size=len(tokenizer)))
    save_for_hub(model, tmp_path / "folder", tokenizer=tokenizer)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "transformers.cli.transformers", "serve", str(tmp_path / "folder"),
                           "--port", "0", "--device", "cpu", *flags], capture_output=True, text=True, timeout=300,
                          env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    said = PLAIN_SERVE_DIES[flags]
    assert done.returncode != 0 and said in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().split())
    assert f"`{said}`" in page
