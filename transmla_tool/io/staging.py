"""Write outputs into a hidden staging directory beside the target and rename it at the end, and never
replace anything this tool did not write.

A failure, Ctrl-C or kill never leaves a directory at the target path that looks finished: until
the final rename the work lives in `.<name>.partial`. What happens to that directory when the work
stops early depends on what is in it:
- an error in the input (`UserError`), or nothing worth keeping yet: it is removed;
- an interrupt or crash after some work was checkpointed (the producer wrote `RESUMABLE_MARK`): it
  is kept, and the message says how to continue (`--resume`) or discard it (`--overwrite`).
A kill -9 cannot run any of this; the directory is then simply there for `--resume`, and a staging
directory that holds nothing resumable (no `RESUMABLE_MARK`, no live writer) is cleared by the next run.

`--overwrite` replaces only a previous output of this tool (a directory carrying `MARKER`, or the records
older versions wrote), never one that is or contains an input of the run, and never one another live
process is writing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from ..errors import UserError

RESUMABLE_MARK = "RESUMABLE"
COMPLETE_MARK = "COMPLETE"  # every file is written; only the rename is left (a resume just renames)
ASSEMBLED_MARK = "ASSEMBLED"  # the shards are complete (io/writer.py); the parts may already be gone
LOCK_FILE = "LOCK"
MARKS = (ASSEMBLED_MARK, RESUMABLE_MARK, COMPLETE_MARK, LOCK_FILE)  # removed before the final rename
MARKER = ".transmla-tool.json"  # in every directory this tool writes: what wrote it
# what older versions left in their outputs, accepted as a marker: (file, kind)
LEGACY_RECORDS = (("conversion.json", "convert"), ("sweep.json", "sweep"), ("report.json", "eval"))
# (staging directory, how to continue) kept for --resume by this process: the CLI names those still there at exit
KEPT: list[tuple[Path, str]] = []


def kept_message() -> str | None:
    """What an interrupted command leaves to continue from, in one line (None: nothing)."""
    kept = [(path, hint) for path, hint in KEPT if path.exists()]
    if not kept:
        return None
    path, hint = kept[-1]
    return f"unfinished work kept in {path}: {hint} to continue, or with --overwrite to start over"


def marker_of(directory: Path) -> dict | None:
    """What this tool recorded of the directory it wrote, or None when it did not write it."""
    marker = directory / MARKER
    if marker.is_file():
        try:
            record = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return record if isinstance(record, dict) and record.get("tool") == "transmla_tool" else None
    for name, kind in LEGACY_RECORDS:
        path = directory / name
        if path.is_file():
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if kind != "convert" or (isinstance(record, dict) and record.get("tool") == "transmla_tool"):
                return {"tool": "transmla_tool", "kind": kind, "legacy": True}
    return None


def write_marker(directory: Path, kind: str, parts: list[str] | None = None) -> None:
    from .. import __version__

    record = {"tool": "transmla_tool", "version": __version__, "kind": kind, "pid": os.getpid(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "parts": sorted(parts or [])}
    (Path(directory) / MARKER).write_text(json.dumps(record, indent=2))


def local_paths(*specs: str | None) -> list[Path]:
    """The local files and directories among model paths and data specs (a data mix `A=2,B=1` gives A and B);
    hub ids and hub datasets are not paths and are left out."""
    from ..data import parse_mix

    found = []
    for spec in specs:
        if not spec:
            continue
        candidates = [spec] if Path(spec).exists() else [source for source, _ in parse_mix(spec)]
        found += [Path(c).resolve() for c in candidates if Path(c).exists()]
    return found


def check_not_input(target: Path, inputs: list[Path], flag: str = "output") -> None:
    """Refuse an output path that is, or contains, an input of the run."""
    resolved = target.resolve()
    for path in inputs:
        if path == resolved or path.is_relative_to(resolved):
            what = "is" if path == resolved else "contains"
            raise UserError(f"{flag} {target} {what} an input of this run ({path}); writing there would destroy it: "
                            "choose another path")


def _live_lock(staging: Path) -> int | None:
    """The pid of a live process writing `staging`, or None."""
    lock = staging / LOCK_FILE
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, another user's
    return pid


def _check_replaceable(target: Path) -> None:
    """--overwrite replaces only a previous output of this tool, and only as a whole."""
    record = marker_of(target)
    if record is None:
        raise UserError(f"{target} exists and was not written by transmla-tool (no {MARKER}); --overwrite replaces "
                        "only this tool's own outputs: move it away yourself or choose another path")
    parts = {Path(p) for p in record.get("parts", [])}
    for root, dirs, files in os.walk(target):
        here = Path(root)
        if here == target:
            continue
        relative = here.relative_to(target)
        foreign = (MARKER in files and relative not in parts) or (
            LOCK_FILE in files and _live_lock(here) is not None)
        if foreign:
            raise UserError(f"{target} holds {here}, which another run wrote (or is writing); --overwrite would delete "
                            "it: move it out first or choose another path")
        if relative in parts:
            dirs[:] = []  # a part of the output this tool listed: replaced with it


def check_target(path: str | Path, overwrite: bool, inputs: list[Path] = (), flag: str = "output") -> Path:
    """The output path, checked before any work: not a file, not an input, not another program's directory.
    Nothing is created here: a refused command leaves no directory behind."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UserError(f"{flag} {target} is a file; give a directory path (this command writes a directory)")
    check_not_input(target, list(inputs), flag)
    if target.exists():
        if not overwrite:
            raise UserError(f"{flag} {target} already exists; pass --overwrite to replace it (only a directory "
                            "transmla-tool wrote is replaced)")
        _check_replaceable(target)
    pid = _live_lock(staging_path(target))
    if pid is not None:
        raise UserError(f"another process (pid {pid}) is writing {target}; wait for it or stop it")
    check_writable(target)
    return target


def check_writable(target: Path, needed_bytes: int = 0) -> None:
    """The nearest existing parent of `target` is writable and (when asked) has room for `needed_bytes`."""
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot create {target}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {parent} (permission denied); choose an output path you can write")
    if needed_bytes:
        free = shutil.disk_usage(parent).free
        if free < needed_bytes:
            raise UserError(f"{parent} has {free / 2**30:.1f} GiB free but the output needs about "
                            f"{needed_bytes / 2**30:.1f} GiB; free space or choose another path")


def make_parents(target: Path) -> list[Path]:
    """Create the missing parent directories of `target`; returns them, deepest first (for remove_empty)."""
    created, parent = [], target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    return created


def remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (or already gone): leave it and everything above it


def staging_path(path: str | Path) -> Path:
    target = Path(path)
    return target.parent / f".{target.name}.partial"


def _lock(staging: Path) -> None:
    pid = _live_lock(staging)
    if pid is not None:
        raise UserError(f"another process (pid {pid}) is writing {staging}; wait for it or stop it")
    lock = staging / LOCK_FILE
    tmp = staging / f"{LOCK_FILE}.{os.getpid()}"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, lock)


def resumable(staging: Path) -> bool:
    return (staging / RESUMABLE_MARK).exists() or (staging / COMPLETE_MARK).exists()


@contextlib.contextmanager
def staged_directory(path: str | Path, overwrite: bool, resume: bool = False, kind: str = "output",
                     inputs: list[Path] = (), parts=None, resume_hint: str = "rerun the same command with --resume",
                     transient: tuple[str, ...] = ()):
    """Yield a staging directory; on success it replaces `path`.

    resume=True continues in an existing staging directory (the producer decides what in it to
    reuse); otherwise an existing one with resumable work is an error unless `overwrite` discards it, and one
    with nothing resumable in it (a run killed before its first checkpoint, or during an export that is simply
    redone) is cleared. `parts(staging)` names the subdirectories that belong to the output (for its marker);
    `transient` the producer's working subdirectories, removed before the rename.
    """
    target = check_target(path, overwrite, inputs)
    staging = staging_path(target)
    if staging.exists():
        if not staging.is_dir():
            raise UserError(f"{staging} is in the way of the staging directory and is not one; move it away")
        pid = _live_lock(staging)
        if pid is not None:
            raise UserError(f"another process (pid {pid}) is writing {target}; wait for it or stop it")
        if resumable(staging) and not resume:
            if not overwrite:
                raise UserError(f"unfinished work for {target} is in {staging}; {resume_hint} to continue it, or "
                                "pass --overwrite to discard it")
            shutil.rmtree(staging)
        elif not resumable(staging) and not resume:
            shutil.rmtree(staging)  # nothing in it to continue from
    parents = make_parents(target)
    staging.mkdir(exist_ok=True)
    _lock(staging)
    write_marker(staging, kind)
    try:
        yield staging
    except UserError:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(parents)
        raise
    except BaseException:
        if resumable(staging):
            (staging / LOCK_FILE).unlink(missing_ok=True)
            KEPT.append((staging, resume_hint))  # the CLI says so, for what is still there when it exits
        else:
            shutil.rmtree(staging, ignore_errors=True)
            remove_empty(parents)
        raise
    write_marker(staging, kind, parts(staging) if parts else None)
    for name in transient:
        shutil.rmtree(staging / name, ignore_errors=True)
    for name in MARKS:
        (staging / name).unlink(missing_ok=True)
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(target)


@contextlib.contextmanager
def staged_file(path: str | Path, overwrite: bool, inputs: list[Path] = (), is_ours=None):
    """Yield a temporary path beside `path`; on success it replaces `path` (os.replace). An existing file is
    replaced only with `overwrite` and when `is_ours(path)` says this tool wrote it."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"output {target} is a directory; give a file path")
    check_not_input(target, list(inputs))
    if target.exists():
        if not overwrite:
            raise UserError(f"{target} already exists; pass --overwrite to replace it")
        if is_ours is not None and not is_ours(target):
            raise UserError(f"{target} was not written by transmla-tool; --overwrite replaces only this tool's own "
                            "outputs: move it away yourself or choose another path")
    check_writable(target)
    parents = make_parents(target)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        yield partial
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        remove_empty(parents)
        raise
