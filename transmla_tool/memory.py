"""Process memory readings on Linux: the kernel's peak RSS (VmHWM) and its reset, and the conversion's
per-stage accounting of time and memory built on them (the evaluation's peak-memory measurement uses them too)."""

from __future__ import annotations

import contextlib
import time

import torch


def reset_rss_peak() -> None:
    """Reset VmHWM to the current RSS (/proc/self/clear_refs; a no-op where it is absent)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def vm_rss_mb() -> float | None:
    """Resident memory now, in MiB, or None where /proc is absent."""
    return _status_mb("VmRSS:")


def vm_hwm_mb() -> float | None:
    """Peak RSS since the last reset, in MiB, or None where /proc is absent."""
    return _status_mb("VmHWM:")


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Stages:
    """Wall seconds and peak memory per conversion stage (summed / maxed over layers).

    Peak memory per stage: the kernel's peak RSS (VmHWM), reset at the start of each stage through
    /proc/self/clear_refs (Linux; absent elsewhere), and on a GPU the allocator's peak."""

    def __init__(self, device: torch.device | None = None):
        self.seconds: dict[str, float] = {}
        self.peak_rss_mb: dict[str, float] = {}
        self.peak_gpu_mb: dict[str, float] = {}
        self.overall_rss_mb = 0.0
        self.device = device

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.device is not None and self.device.type == "cuda"
        self.overall_rss_mb = max(self.overall_rss_mb, vm_hwm_mb() or 0.0)
        reset_rss_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                gpu = torch.cuda.max_memory_allocated(self.device) / 2**20
                self.peak_gpu_mb[name] = max(self.peak_gpu_mb.get(name, 0.0), gpu)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            rss = vm_hwm_mb()
            if rss is not None:
                self.peak_rss_mb[name] = max(self.peak_rss_mb.get(name, 0.0), rss)
                self.overall_rss_mb = max(self.overall_rss_mb, rss)

    def as_dict(self) -> dict:
        return {name: {"seconds": round(sec, 2), "peak_rss_mb": round(self.peak_rss_mb.get(name, 0.0), 1),
                       **({"peak_gpu_mb": round(self.peak_gpu_mb[name], 1)} if name in self.peak_gpu_mb else {})}
                for name, sec in self.seconds.items()}


def stage_line(stages: dict) -> str:
    """'refine 700.1 s (81%), source forward 109.0 s (13%), ...': the conversion's stages by time, largest first."""
    total = sum(v["seconds"] for v in stages.values()) or 1.0
    ordered = sorted(stages.items(), key=lambda kv: -kv[1]["seconds"])
    return ", ".join(f"{name} {v['seconds']:.1f} s ({v['seconds'] / total:.0%})" for name, v in ordered)
