"""Engine tools run as child processes that end with the benchmark that started them.

A benchmark stopped from outside (`kill`, `pkill -f eval/frontier.py`, a CI timeout) used to leave its
llama-perplexity or vLLM child running for up to an hour, taking the CPU from whatever ran next and
slowing its timings. On Linux each child asks the kernel for SIGTERM when its parent dies
(prctl PR_SET_PDEATHSIG), however the parent died; elsewhere the children run as before.
"""

from __future__ import annotations

import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _terminate_with_parent() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def child_kwargs() -> dict:
    """subprocess.Popen keyword arguments for a child that is terminated when this process dies (Linux)."""
    return {"preexec_fn": _terminate_with_parent} if sys.platform.startswith("linux") else {}


def run_child(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kwargs) whose child is terminated when this process dies (Linux)."""
    return subprocess.run([str(c) for c in cmd], **{**child_kwargs(), **kwargs})
