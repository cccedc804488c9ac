"""`resformer-convert --refresh-code`: everything is checked before anything is written.

Each refused folder must come out byte-identical (names, bytes and modes of every entry, hidden ones included) after
exit status 2 and one line naming the file and the problem. The accepted ones get exactly this plugin's code, new
files with the modes `open()` gives under the umask, and `config.json` with only its `auto_map` text changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from resformer_hf import refresh_code
from resformer_hf.cli.convert import main as convert_main
from resformer_hf.hub import finish_hub_folder
from resformer_hf.registration import full_auto_map

from helpers import model_with_random_lambdas, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("refresh") / "saved"
    model = model_with_random_lambdas(tiny_config("learnable_plus"))
    model.save_pretrained(folder)
    finish_hub_folder(folder, model.config)
    return folder


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    copy = tmp_path / "folder"
    shutil.copytree(saved, copy)
    return copy


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every entry below `folder`: its mode and, for files, the sha256 of its bytes."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        entries[path.relative_to(folder).as_posix()] = (stat.S_IMODE(path.lstat().st_mode), digest)
    return entries


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def assert_refused(folder: Path, capsys, *message: str, argv: tuple[str, ...] = ()) -> None:
    before = snapshot(folder)
    capsys.readouterr()  # drop what building the folder printed
    assert convert_main(["--refresh-code", str(folder), *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("resformer-convert: error:") and error.count("\n") == 1, error
    for part in message:
        assert part in error, error
    assert snapshot(folder) == before


@pytest.mark.parametrize("auto_map", ["x", ["x"], 1, {"AutoModelForCausalLM": 5}, {"AutoConfig": "noclass"}])
def test_a_malformed_auto_map_is_refused_before_any_code_is_written(folder, capsys, auto_map):
    edit_config(folder, auto_map=auto_map)
    (folder / "modeling_resformer.py").write_text("# stale\n")
    assert_refused(folder, capsys, "config.json", "auto_map")


@pytest.mark.parametrize(("fields", "named"), [
    ({"value_residual": "bogus_variant"}, "bogus_variant"),
    ({"num_hidden_layers": "x"}, "num_hidden_layers"),
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_size": 64}, "shape"),
    ({"value_residual": "svformer"}, "Variant mismatch"),
])
def test_a_config_that_cannot_load_the_folder_is_refused(folder, capsys, fields, named):
    edit_config(folder, **fields)
    assert_refused(folder, capsys, "config.json", named)


def test_svformer_weights_under_a_config_with_value_projections_are_refused(tmp_path, capsys):
    folder = tmp_path / "svformer"
    model = model_with_random_lambdas(tiny_config("svformer"))
    model.save_pretrained(folder)
    finish_hub_folder(folder, model.config)
    edit_config(folder, value_residual="learnable_plus")
    assert_refused(folder, capsys, "config.json", "Variant mismatch")


def test_deeply_nested_json_is_refused_cleanly(folder, capsys):
    (folder / "config.json").write_text('{"model_type": "resformer", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert_refused(folder, capsys, "config.json", "nested too deeply")


def test_a_target_that_is_not_a_file_is_refused_before_anything_is_written(folder, capsys):
    (folder / "modeling_resformer.py").unlink()
    (folder / "modeling_resformer.py").mkdir()
    assert_refused(folder, capsys, "modeling_resformer.py", "not a regular file")


def test_a_write_that_fails_midway_leaves_the_folder_as_it_was(folder, capsys, monkeypatch):
    """A full disk while staging the third file: the staged ones are removed, no target was touched."""
    real_stage, calls = refresh_code._stage, []

    def stage_until_the_disk_is_full(target, content):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_stage(target, content)

    monkeypatch.setattr(refresh_code, "_stage", stage_until_the_disk_is_full)
    (folder / "modeling_resformer.py").write_text("# stale\n")
    assert_refused(folder, capsys, "cannot write", "No space left on device")
    assert len(calls) == 3


@pytest.mark.parametrize("argv", [("--variant", "svformer"), ("--overwrite",), ("--dtype", "bfloat16"),
                                  ("--init", "paper"), ("--verify",), ("--allow-pickle",)])
def test_conversion_flags_are_an_error_with_refresh_code(folder, capsys, argv):
    before = snapshot(folder)
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--refresh-code", str(folder), *argv])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1 and argv[0] in error and "does not apply" in error
    assert snapshot(folder) == before


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_new_files_get_the_umask_modes_and_replaced_files_keep_theirs(folder, umask):
    (folder / "_compat.py").unlink()
    (folder / "loading.py").unlink()
    os.chmod(folder / "modeling_resformer.py", 0o640)
    previous = os.umask(umask)
    try:
        assert convert_main(["--refresh-code", str(folder)]) == 0
    finally:
        os.umask(previous)
    for name in ("_compat.py", "loading.py"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((folder / "modeling_resformer.py").stat().st_mode) == 0o640
    assert not [path.name for path in folder.iterdir() if path.name.startswith(".")]


def test_config_json_changes_only_in_its_auto_map_text(folder):
    """Key order, non-ASCII text, number spelling and layout of every other member stay exactly as written."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("auto_map")
    config["_name_or_path"] = "modèle/ünïcode"
    config = {"zz_first": 1, **dict(reversed(config.items()))}
    head = json.dumps(config, indent=4, ensure_ascii=False)[:-2]
    head = head.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-6')
    assert "1e-6" in head
    stale = {"AutoTokenizer": ["tokenization_x.XTokenizer", None], "AutoModelForCausalLM": "old.Old"}
    for text in (head + ',\n    "auto_map": ' + json.dumps(stale) + "\n}\n", head + "\n}\n"):
        (folder / "config.json").write_text(text, encoding="utf-8")
        assert convert_main(["--refresh-code", str(folder)]) == 0
        refreshed = (folder / "config.json").read_text(encoding="utf-8")
        assert refreshed.startswith(head + ',\n    "auto_map": {\n        "') and refreshed.endswith("\n}\n")
        parsed = json.loads(refreshed)
        expected = {**stale, **full_auto_map()} if "auto_map" in text else full_auto_map()
        assert parsed.pop("auto_map") == expected
        assert list(parsed) == list(config)
