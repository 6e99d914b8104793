"""Write outputs into a hidden staging directory beside the target and rename it at the end.

A failure, Ctrl-C or kill never leaves a directory at the target path that looks finished: until
the final rename the work lives in `.<name>.partial-<pid>` and is removed on any exception.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..errors import UserError


def check_target(path: str | Path, overwrite: bool) -> Path:
    target = Path(path)
    if target.exists() and not overwrite:
        raise UserError(f"output {target} already exists; pass --overwrite to replace it")
    if target.exists() and not target.is_dir():
        raise UserError(f"output {target} exists and is not a directory")
    if not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    return target


@contextlib.contextmanager
def staged_directory(path: str | Path, overwrite: bool):
    """Yield a staging directory; on success it replaces `path`, on failure it is deleted."""
    target = check_target(path, overwrite)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(target)
