"""`resformer-serve`'s bad input follows the commands' contract (one line `resformer-serve: error: ...`, status 2),
before any server starts; the server itself is tested in test_serving_hf.py."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from transformers.utils.import_utils import is_serve_available

from resformer_hf.cli.serve import main


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
