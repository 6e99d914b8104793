"""Process memory readings on Linux: the kernel's peak RSS (VmHWM) and its reset. Shared by the
conversion's per-stage accounting and the evaluation's peak-memory measurement."""

from __future__ import annotations


def reset_rss_peak() -> None:
    """Reset VmHWM to the current RSS (/proc/self/clear_refs; a no-op where it is absent)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def vm_hwm_mb() -> float | None:
    """Peak RSS since the last reset, in MiB, or None where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
