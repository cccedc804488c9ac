"""Output directories that appear complete or not at all, and never at the cost of anything the user already has.

Generic (imports nothing from `resformer_hf`). A tool writes into a hidden staging directory beside the destination
(same file system) and `commit`s it with one `rename`, which the kernel performs only while the destination is
missing or empty: files that appear there during the run (another tool, or a second run to the same folder) make the
commit refuse instead of vanishing. Replacing a non-empty destination needs `replace=True`.

- The staging directory is created with mode 0o777 minus the umask (as `mkdir` would create the destination), and an
  existing destination's mode and group are carried over to what replaces it.
- Staging names are `.<name>.partial-<pid>-<token>` and hold an owner file (host, pid); a later run to the same
  destination removes those whose process is gone and names, in one line, any it cannot prove abandoned.
- `check_output_path` refuses paths whose replacement would delete more than an output: the empty path (an unset
  shell variable), the file-system root, the home and current directories and their ancestors, symbolic links, and
  folders that hold the tool's own inputs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

OWNER_FILE = ".staging-owner.json"
#: Longest destination name kept verbatim inside staging names; longer names are shortened with a hash.
_NAME_ROOM = 120


class OutputPathError(ValueError):
    """An output path that must not be written or replaced; the message says why and what to pass instead."""


class DestinationChangedError(OutputPathError):
    """The destination received files while the output was being written; nothing there was changed."""

    def __init__(self, destination: Path, kept: Path):
        super().__init__(
            f"{destination} received files while the output was being written (another run to the same folder?); "
            f"nothing in it was changed. The new output is complete at {kept}: move it where you want it, or run "
            "again and allow replacing the destination",
        )
        self.destination, self.kept = destination, kept


def short_name(name: str) -> str:
    """`name` if it leaves room for a suffix within the file system's 255-byte limit, else a prefix plus a hash."""
    if len(name.encode()) <= _NAME_ROOM:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[:80].decode(errors="ignore") + "~" + digest


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _place(where) -> Path | None:
    """`Path.cwd()` / `Path.home()` resolved, or None where there is none (a deleted cwd, no HOME)."""
    try:
        return where().resolve()
    except (OSError, RuntimeError, KeyError):
        return None


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_path(
    path: str | os.PathLike,
    *,
    label: str,
    replace: bool,
    replace_hint: str,
    inputs: Mapping[str, str | os.PathLike] = MappingProxyType({}),
) -> Path:
    """The absolute output path, or an `OutputPathError` saying why it must not be used.

    `label` names the path in messages (e.g. "DST", "--output"); `replace_hint` says how to allow replacing a
    non-empty folder (e.g. "pass --overwrite"); `inputs` maps labels to the local paths the run reads, which the
    output must neither contain nor lie inside.
    """
    text = os.fspath(path)
    if not text.strip():
        raise OutputPathError(f"{label} is empty (an unset shell variable?); pass the folder to write.")
    output = Path(text).expanduser().absolute()
    if not output.parent.is_dir():
        raise OutputPathError(f"the parent folder of {label}, {output.parent}, does not exist; create it first.")
    limit = _name_max(output.parent)
    if len(os.fsencode(output.name)) > limit:
        raise OutputPathError(f"{label} name is {len(os.fsencode(output.name))} bytes long; the file system allows "
                              f"{limit}. Choose a shorter name.")
    if output.is_symlink():
        raise OutputPathError(f"{label} {output} is a symbolic link; pass the folder it points to, or a new path.")
    real = output.resolve()
    if real == Path(real.anchor):
        raise OutputPathError(f"{label} {output} is the root of the file system; pass a new folder.")
    for place, what in ((_place(Path.cwd), "the current directory"), (_place(Path.home), "your home folder")):
        if place is not None and _is_within(place, real):
            raise OutputPathError(f"{label} {output} is {what} or contains it; writing there would replace it. Pass "
                                  "a new folder.")
    for input_label, item in inputs.items():
        source = Path(item).expanduser()
        if not source.exists():  # a Hub id, not a local path
            continue
        source = source.resolve()
        if _is_within(source, real):
            raise OutputPathError(f"{label} {output} is or holds {input_label} {item}; writing there would replace "
                                  "it. Pass another folder.")
        if _is_within(real, source):
            raise OutputPathError(f"{label} {output} is inside {input_label} {item}; pass a folder outside it.")
    if output.exists() and not output.is_dir():
        raise OutputPathError(f"{label} {output} is a file; pass a folder path.")
    if output.is_dir() and any(output.iterdir()) and not replace:
        raise OutputPathError(f"{label} {output} exists and is not empty; {replace_hint} to replace it.")
    return output


def _process_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: never call a run abandoned
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _owner(staging: Path) -> dict | None:
    try:
        owner = json.loads((staging / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def sweep_stale(destination: Path) -> tuple[list[Path], list[Path]]:
    """Remove the staging directories of `destination` whose process on this host is gone; return (removed, left):
    `left` holds the ones that may still be in use or that this code did not make (including a destination set
    aside by a replacement that was killed halfway), for the caller to name."""
    removed, left = [], []
    prefix = f".{short_name(destination.name)}."
    for candidate in sorted(destination.parent.glob(prefix + "*")):
        kind = candidate.name[len(prefix):].partition("-")[0]
        if kind not in ("partial", "replaced") or candidate.is_symlink() or not candidate.is_dir():
            continue
        owner = _owner(candidate) if kind == "partial" else None
        if owner and owner.get("host") == socket.gethostname() and not _process_alive(owner["pid"]):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
        else:
            left.append(candidate)
    return removed, left


def _sibling(destination: Path, kind: str, *, hidden: bool = True) -> Path:
    name = f"{short_name(destination.name)}.{kind}-{os.getpid()}-{secrets.token_hex(3)}"
    return destination.parent / (f".{name}" if hidden else name)


def _carry_mode(staging: Path, destination: Path) -> None:
    """Give the staging directory the mode and group of the destination it replaces, if there is one."""
    try:
        existing = destination.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(existing.st_mode):
        return
    os.chmod(staging, stat.S_IMODE(existing.st_mode))
    if staging.stat().st_gid != existing.st_gid:
        try:
            os.chown(staging, -1, existing.st_gid)
        except PermissionError:  # not a member of that group: keep ours
            pass


class StagedDirectory:
    """`with StagedDirectory(dst) as staged:` write into `staged.path`, then `staged.commit(replace=...)`.

    Leaving the block without a commit (an exception, Ctrl-C, a handled SIGTERM) removes the staging directory.
    """

    def __init__(self, destination: Path):
        self.destination = Path(destination)
        self.path: Path | None = None
        self.removed_stale: list[Path] = []
        self.left_stale: list[Path] = []

    def __enter__(self) -> StagedDirectory:
        self.removed_stale, self.left_stale = sweep_stale(self.destination)
        while self.path is None:
            candidate = _sibling(self.destination, "partial")
            try:
                os.mkdir(candidate, 0o777)  # the umask applies, as for any new folder
            except FileExistsError:
                continue
            self.path = candidate
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "destination": str(self.destination)}
        (self.path / OWNER_FILE).write_text(json.dumps(owner), encoding="utf-8")
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.path is not None and self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self, *, replace: bool) -> None:
        """Move the finished directory to the destination. A missing or empty destination is replaced atomically; a
        non-empty one only with `replace=True`, and its old contents are deleted only after the new ones are in
        place. Without `replace`, a destination that gained files is left untouched and the output is kept beside
        it (`DestinationChangedError` says where)."""
        staging, destination = self.path, self.destination
        _carry_mode(staging, destination)
        (staging / OWNER_FILE).unlink()
        try:
            os.rename(staging, destination)
            self.path = None
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        if not replace or not destination.is_dir() or destination.is_symlink():
            kept = _sibling(destination, "new", hidden=False)
            os.rename(staging, kept)
            self.path = None
            raise DestinationChangedError(destination, kept)
        retired = _sibling(destination, "replaced")
        os.rename(destination, retired)
        try:
            os.rename(staging, destination)
        except BaseException:
            os.rename(retired, destination)
            raise
        self.path = None
        shutil.rmtree(retired, ignore_errors=True)


__all__ = [
    "DestinationChangedError",
    "OutputPathError",
    "StagedDirectory",
    "check_output_path",
    "short_name",
    "sweep_stale",
]
