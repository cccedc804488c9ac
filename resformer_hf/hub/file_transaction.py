"""Replace several files of one folder all or nothing, and finish the job after a kill (`--refresh-code`).

A run holds an exclusive lock on a journal in the folder (`.resformer-refresh-code.tmp`), and writes there, before it
creates anything else, the random token its other files are named with and the targets it will write. Then it:

1. stages every new file beside its target (`.<name>.<token>.tmp`, flushed to disk);
2. keeps every original under a second name (`.<name>.<token>.orig.tmp`: a hard link, or a copy where the file
   system has none), so the target itself is never missing;
3. renames the staged files into place, one by one;
4. only when every rename succeeded, removes the kept originals and the journal.

Any failure in 1-3 puts every original back (removing the files that did not exist before), removes its staging
files and raises `UserInputError` naming the target that failed. A run killed anywhere leaves the journal: the next
run finds it (the lock tells a live run from a dead one), puts the originals back and removes the files that journal
names, and only those, then does its own work. Every file it creates matches `.*.tmp`, which the Hub upload skips.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import UserInputError

try:  # POSIX; elsewhere runs are not protected against a concurrent run in the same folder
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

JOURNAL_NAME = ".resformer-refresh-code.tmp"
_FORMAT = "resformer-refresh-code/1"


def staging_name(target: str, token: str) -> str:
    return f".{target}.{token}.tmp"


def original_name(target: str, token: str) -> str:
    return f".{target}.{token}.orig.tmp"


def _move(source: Path, target: Path) -> None:
    """`os.replace`, the one call that changes what a target name holds (tests inject failures here)."""
    os.replace(source, target)


@contextlib.contextmanager
def folder_lock(directory: Path) -> Iterator[list[str] | None]:
    """Hold the folder's journal locked for the block. Yields None, or when a killed run's journal was there the
    names of the targets whose originals were put back (its staging files are removed too).

    Raises `UserInputError` when another run holds the lock, or when the folder cannot hold the journal."""
    journal = directory / JOURNAL_NAME
    handle = _open_locked(journal)
    try:
        leftover = handle.read()
        restored = _recover(directory, journal, leftover) if leftover.strip() else None
        handle.seek(0)
        handle.truncate()
        yield restored
    finally:
        with contextlib.suppress(FileNotFoundError):
            if _same_file(handle, journal) and os.fstat(handle.fileno()).st_size == 0:
                journal.unlink()
        handle.close()


def _open_locked(journal: Path):
    while True:
        try:
            handle = open(journal, "a+", encoding="utf-8")  # noqa: SIM115 - closed by folder_lock
        except OSError as error:
            raise UserInputError(
                f"cannot create {journal}: {error.strerror or error}; nothing was changed."
            ) from None
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                handle.close()
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UserInputError(
                        f"another --refresh-code is running on {journal.parent} (it holds {journal.name}): wait for "
                        "it to finish; nothing was changed."
                    ) from None
                raise
        if _same_file(handle, journal):  # not a journal that a finishing run unlinked while we waited
            handle.seek(0)
            return handle
        handle.close()


def _same_file(handle, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _recover(directory: Path, journal: Path, text: str) -> list[str]:
    """Undo what the run that wrote `text` (the journal) did: originals back in place, its files removed."""
    try:
        record = json.loads(text)
        token, entries = record["token"], record["targets"]
        if record.get("format") != _FORMAT or not isinstance(token, str) or not token.isalnum():
            raise ValueError(f"format {record.get('format')!r}")
        targets = [(str(entry["name"]), entry["original_sha256"], str(entry["sha256"])) for entry in entries]
        if any(Path(name).name != name or name.startswith(".") for name, _, _ in targets):
            raise ValueError("a target outside the folder")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UserInputError(
            f"{journal} is not a journal this command can read ({error}); an interrupted --refresh-code left it: "
            "check the folder, remove the file, and run the command again. Nothing was changed."
        ) from None
    restored = []
    for name, original_digest, new_digest in targets:
        target, staged, kept = (directory / name, directory / staging_name(name, token),
                                directory / original_name(name, token))
        if kept.exists():
            if target.exists() and os.path.samefile(kept, target):
                kept.unlink()  # never replaced
            elif _sha256(kept) == original_digest:
                _move(kept, target)
                restored.append(name)
            else:
                kept.unlink()  # a copy cut short: renames start only once every original is kept, so none was
        elif original_digest is None and not staged.exists() and target.is_file() and _sha256(target) == new_digest:
            target.unlink()  # a new file that run renamed into place
            restored.append(name)
        staged.unlink(missing_ok=True)
    return restored


def replace_files(directory: Path, contents: Mapping[Path, bytes]) -> None:
    """Write `contents` ({target in `directory`: bytes}) all or nothing; call inside `folder_lock(directory)`."""
    token = secrets.token_hex(4)
    journal = directory / JOURNAL_NAME
    plan = [(target, target.exists()) for target in contents]
    _write_journal(journal, token, plan, contents)
    staged: dict[Path, Path] = {}
    kept: dict[Path, Path] = {}
    renamed: list[Path] = []
    current = None
    try:
        for target, _ in plan:
            current = target
            staged[target] = _stage(target, target.with_name(staging_name(target.name, token)), contents[target])
        for target, existed in plan:
            if existed:
                current = target
                kept[target] = _keep(target, target.with_name(original_name(target.name, token)))
        for target, _ in plan:
            current = target
            _move(staged[target], target)
            del staged[target]
            renamed.append(target)
    except BaseException as error:
        try:
            _put_back(renamed, kept, staged)
        except OSError as undo_error:
            raise UserInputError(
                f"cannot replace {current}: {error}; putting the originals back failed too ({undo_error}): run the "
                f"same command again, it finishes the job ({journal.name} records it)."
            ) from None
        journal.write_text("")
        if isinstance(error, OSError):
            raise UserInputError(
                f"cannot replace {current}: {error.strerror or error}; every file was put back, nothing was changed."
            ) from None
        raise
    for original in kept.values():
        original.unlink()
    journal.write_text("")  # nothing left to recover


def _write_journal(journal: Path, token: str, plan, contents: Mapping[Path, bytes]) -> None:
    record = {"format": _FORMAT, "token": token, "targets": [
        {"name": target.name, "original_sha256": _sha256(target) if existed else None,
         "sha256": hashlib.sha256(contents[target]).hexdigest()}
        for target, existed in plan
    ]}
    with open(journal, "w", encoding="utf-8") as stream:
        json.dump(record, stream)
        stream.flush()
        os.fsync(stream.fileno())


def _stage(target: Path, staging: Path, content: bytes) -> Path:
    """`staging` holding `content`, flushed to disk, with `target`'s mode, or for a new file the mode `open()` gives
    (0666 less the umask, as `save_pretrained`'s files get)."""
    handle = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(content)
            stream.flush()
            os.fsync(stream.fileno())
        if target.exists():
            os.chmod(staging, target.stat().st_mode & 0o7777)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return staging


def _keep(target: Path, original: Path) -> Path:
    """`original`: the same file as `target` (a hard link), or where links are refused a copy with its mode."""
    try:
        os.link(target, original)
    except OSError:
        shutil.copy2(target, original)
    return original


def _put_back(renamed: list[Path], kept: Mapping[Path, Path], staged: Mapping[Path, Path]) -> None:
    """Undo a failed run: each renamed target gets its original back (a new file is removed), then the staging and
    kept files go. A failure here leaves the journal, so the next run finishes the job."""
    for target in reversed(renamed):
        if target in kept:
            _move(kept.pop(target), target)
        else:
            target.unlink()
    for path in [*staged.values(), *kept.values()]:
        path.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


__all__ = ["JOURNAL_NAME", "folder_lock", "original_name", "replace_files", "staging_name"]
