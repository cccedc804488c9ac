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
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from resformer_hf import remote_code
from resformer_hf.cli.convert import main as convert_main
from resformer_hf.hub import file_transaction, finish_hub_folder, refresh_code
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


def assert_refused(folder: Path, capsys, *message: str, argv: tuple[str, ...] = ()) -> str:
    before = snapshot(folder)
    capsys.readouterr()  # drop what building the folder printed
    assert convert_main(["--refresh-code", str(folder), *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("resformer-convert: error:") and error.count("\n") == 1, error
    for part in message:
        assert part in error, error
    assert snapshot(folder) == before
    return error


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
    real_stage, calls = file_transaction._stage, []

    def stage_until_the_disk_is_full(target, staging, content):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_stage(target, staging, content)

    monkeypatch.setattr(file_transaction, "_stage", stage_until_the_disk_is_full)
    (folder / "modeling_resformer.py").write_text("# stale\n")
    error = assert_refused(folder, capsys, "cannot replace", "No space left on device", "every file was put back")
    assert len(calls) == 3 and f"cannot replace {calls[2]}:" in error


def _stale(folder: Path, drop: str | None = "loading.py") -> None:
    """Make the folder's code an older plugin's: every module edited, `drop` missing (a new file for the refresh),
    another `auto_map`; so that every rename changes what the folder holds."""
    for path in folder.glob("*.py"):
        path.write_bytes(b"# an older plugin's code\n" + path.read_bytes())
    if drop:
        (folder / drop).unlink()
    edit_config(folder, auto_map={"AutoConfig": "configuration_resformer.ResFormerConfig"})


@pytest.fixture(scope="module")
def refreshed(saved, tmp_path_factory) -> tuple[list[str], dict[str, tuple[int, str]]]:
    """The targets in the order a refresh renames them, and what a refresh that nothing interrupted makes of a
    `_stale` folder: the state every test below must reach after its re-run."""
    copy = tmp_path_factory.mktemp("clean") / "folder"
    shutil.copytree(saved, copy)
    _stale(copy)
    targets = refresh_code.refresh_remote_code(copy)
    code = sorted(path.name for path in saved.glob("*.py"))  # every module the plugin copies as remote code
    assert sorted(targets[:-1]) == code and targets[-1] == "config.json" and "loading.py" in targets
    return targets, snapshot(copy)


def _is_rename_into_place(source: Path) -> bool:
    return source.name.endswith(".tmp") and not source.name.endswith(".orig.tmp")


#: What a refresh renames: every remote-code module (`resformer_hf/remote_code/` less its `__init__.py`), then
#: config.json.
RENAMES = len([path for path in Path(remote_code.__file__).parent.glob("*.py") if path.name != "__init__.py"]) + 1


@pytest.mark.parametrize("k", range(RENAMES))
def test_a_rename_that_fails_after_k_renames_puts_every_original_back(folder, capsys, monkeypatch, k, refreshed):
    """The (k+1)-th rename into place fails: the k renamed targets get their originals back (the new file is
    removed), the error names the target, the folder is byte-identical; the next run completes."""
    targets, expected = refreshed
    _stale(folder)
    real_move, renamed = file_transaction._move, []

    def move(source, target):
        if _is_rename_into_place(source):
            renamed.append(target.name)
            if len(renamed) == k + 1:
                raise PermissionError(1, "Operation not permitted")
        real_move(source, target)

    monkeypatch.setattr(file_transaction, "_move", move)
    assert_refused(folder, capsys, f"cannot replace {folder / targets[k]}:", "Operation not permitted",
                   "every file was put back")
    assert renamed == targets[: k + 1]
    monkeypatch.undo()
    assert convert_main(["--refresh-code", str(folder)]) == 0
    assert snapshot(folder) == expected


def _chattr(path: Path, flag: str) -> bool:
    return shutil.which("chattr") is not None and subprocess.run(["chattr", flag, str(path)]).returncode == 0


@pytest.mark.parametrize("position", range(RENAMES))
def test_an_immutable_target_at_any_position_leaves_the_folder_as_it_was(folder, capsys, position, refreshed):
    """The issue's case, not simulated: a target that cannot be replaced (`chattr +i`), first, last or between."""
    targets, expected = refreshed
    _stale(folder, drop=None)
    target = folder / targets[position]
    if not _chattr(target, "+i"):
        pytest.skip("needs chattr +i (root, on a file system with file attributes)")
    try:
        assert_refused(folder, capsys, f"cannot replace {target}:", "every file was put back")
    finally:
        assert _chattr(target, "-i")
    (folder / "loading.py").unlink()
    assert convert_main(["--refresh-code", str(folder)]) == 0
    assert snapshot(folder) == expected


#: Where the forked run is killed: while staging the 3rd file, keeping the 2nd original, before the (k+1)-th rename
#: into place (k = 0..12), and while removing the kept originals after the last rename.
KILL_POINTS = [("stage", 2), ("keep", 1), *(("rename", k) for k in range(RENAMES)), ("cleanup", 0)]


def _killed_run(folder: Path, where: str, k: int) -> int:
    """Refresh `folder` in a forked child that SIGKILLs itself (no cleanup runs) at `where`, the (k+1)-th time."""
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    try:  # the child never returns to pytest
        calls = []

        def kill_at(point: str, wrapped):
            def call(*args):
                if point == where:
                    calls.append(args)
                    if len(calls) == k + 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                return wrapped(*args)
            return call

        move, stage, keep, unlink = (file_transaction._move, file_transaction._stage, file_transaction._keep,
                                     Path.unlink)
        file_transaction._move = lambda source, target: (
            kill_at("rename", move) if _is_rename_into_place(source) else move)(source, target)
        file_transaction._stage = kill_at("stage", stage)
        file_transaction._keep = kill_at("keep", keep)
        Path.unlink = lambda path, **kw: (
            kill_at("cleanup", unlink) if path.name.endswith(".orig.tmp") else unlink)(path, **kw)
        refresh_code.refresh_remote_code(folder)
    finally:
        os._exit(3)


@pytest.mark.parametrize(("where", "k"), KILL_POINTS)
def test_a_rerun_after_a_kill_puts_originals_back_removes_its_files_and_completes(folder, where, k, refreshed):
    targets, expected = refreshed
    _stale(folder)
    before = snapshot(folder)
    status = _killed_run(folder, where, k)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    hidden = {name for name in os.listdir(folder) if name.startswith(".")}
    assert file_transaction.JOURNAL_NAME in hidden and len(hidden) > 1, hidden  # the dead run's files are there
    changed = {name for name, entry in snapshot(folder).items() if before.get(name) != entry} - hidden
    assert changed == set(targets[: k if where == "rename" else len(targets) if where == "cleanup" else 0])
    with pytest.warns(UserWarning, match="interrupted --refresh-code"):
        assert convert_main(["--refresh-code", str(folder)]) == 0
    assert snapshot(folder) == expected


def test_a_run_while_another_holds_the_folder_is_refused(folder, capsys):
    """Two runs at once: the second one stops with a message (it must not take the first one's files for a dead
    run's), and the folder is left to the first."""
    import fcntl

    journal = folder / file_transaction.JOURNAL_NAME
    with open(journal, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        before = snapshot(folder)
        capsys.readouterr()
        assert convert_main(["--refresh-code", str(folder)]) == 2
        assert "another --refresh-code is running" in capsys.readouterr().err
        assert snapshot(folder) == before
    journal.unlink()
    assert convert_main(["--refresh-code", str(folder)]) == 0
    assert not [name for name in os.listdir(folder) if name.startswith(".")]


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


def test_an_older_plugins_module_the_new_code_does_not_import_is_kept_and_named(folder, capsys):
    """Folders written before the value code moved into family files hold `value_mixing.py`: the refresh writes the
    new modules and leaves it (a command deletes nothing it did not create), saying so, from the command and from
    Python alike."""
    old = folder / "value_mixing.py"
    old.write_bytes(b"raise RuntimeError('an older plugin module, never imported')\n")
    before = old.read_bytes()
    with pytest.warns(UserWarning, match="left as they were: value_mixing.py") as warned:
        assert convert_main(["--refresh-code", str(folder)]) == 0
    assert "delete them if nothing else needs them" in str(warned[0].message)
    assert "refreshed" in capsys.readouterr().out
    assert old.read_bytes() == before
    assert (folder / "value_residual.py").is_file() and (folder / "cache_resformer.py").is_file()
