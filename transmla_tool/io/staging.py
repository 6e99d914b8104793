"""Write outputs into a hidden staging directory beside the target and rename it at the end.

A failure, Ctrl-C or kill never leaves a directory at the target path that looks finished: until
the final rename the work lives in `.<name>.partial`. What happens to that directory when the work
stops early depends on what is in it:
- an error in the input (`UserError`), or nothing worth keeping yet: it is removed;
- an interrupt or crash after some work was checkpointed (the producer wrote `RESUMABLE_MARK`): it
  is kept, and the message says how to continue (`--resume`) or discard it (`--overwrite`).
A kill -9 cannot run any of this; the directory is then simply there for `--resume`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from ..errors import UserError

RESUMABLE_MARK = "RESUMABLE"
LOCK_FILE = "LOCK"


def check_target(path: str | Path, overwrite: bool) -> Path:
    target = Path(path)
    if target.exists() and not overwrite:
        raise UserError(f"output {target} already exists; pass --overwrite to replace it")
    if target.exists() and not target.is_dir():
        raise UserError(f"output {target} exists and is not a directory")
    return target  # nothing is created here: a refused command leaves no directory behind


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
    lock = staging / LOCK_FILE
    if lock.exists():
        try:
            pid = int(lock.read_text().strip())
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError):
            pass  # a dead process's lock
        else:
            if pid != os.getpid():
                raise UserError(f"another process (pid {pid}) is writing {staging}; wait for it or stop it")
    lock.write_text(str(os.getpid()))


@contextlib.contextmanager
def staged_directory(path: str | Path, overwrite: bool, resume: bool = False):
    """Yield a staging directory; on success it replaces `path`.

    resume=True continues in an existing staging directory (the producer decides what in it to
    reuse); otherwise an existing one is an error unless `overwrite` discards it.
    """
    target = check_target(path, overwrite)
    staging = staging_path(target)
    if staging.exists() and not resume:
        if not overwrite:
            raise UserError(f"an unfinished conversion is in {staging}; pass --resume to continue it or "
                            "--overwrite to discard it")
        shutil.rmtree(staging)
    parents = make_parents(target)
    staging.mkdir(exist_ok=True)
    _lock(staging)
    try:
        yield staging
    except UserError:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(parents)
        raise
    except BaseException:
        if (staging / RESUMABLE_MARK).exists():
            (staging / LOCK_FILE).unlink(missing_ok=True)
            print(f"unfinished work kept in {staging}: rerun the same command with --resume to continue, or "
                  "with --overwrite to start over", file=sys.stderr)
        else:
            shutil.rmtree(staging, ignore_errors=True)
            remove_empty(parents)
        raise
    for name in (RESUMABLE_MARK, LOCK_FILE):
        (staging / name).unlink(missing_ok=True)
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(target)
