"""The kernel's peak-RSS readings behind conversion.json's and healing.json's memory figures (Linux)."""

import mmap
from pathlib import Path

import pytest

from transmla_tool.memory import Stages, reset_rss_peak, vm_hwm_mb, vm_rss_mb

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")


def _touch(mb: int) -> mmap.mmap:
    """`mb` MiB made resident, in an anonymous mapping of its own: closing it returns the pages to the kernel at once.
    (A torch tensor's memory goes back through the C allocator, which may keep it mapped: on CI one 400 MB tensor
    was still resident after `del`, so the reset had nothing to lower.)"""
    area = mmap.mmap(-1, mb * 2**20)
    for offset in range(0, len(area), mmap.PAGESIZE):
        area[offset] = 1
    return area


def test_reset_lowers_the_peak_to_the_current_rss():
    big = _touch(400)
    before = vm_hwm_mb()
    big.close()
    reset_rss_peak()
    after, now = vm_hwm_mb(), vm_rss_mb()
    assert after < before - 300, (before, after)
    assert after - now < 50, (after, now)  # the peak starts again from what is resident


def test_stages_keep_the_overall_peak_across_their_resets():
    """Each stage resets the counter for its own peak; the overall peak (conversion.json's peak_rss_mb) must still see
    a large stage that came before a small one."""
    stages = Stages()
    reset_rss_peak()
    base = vm_hwm_mb()
    with stages("large"):
        _touch(400).close()
    with stages("small"):
        _touch(8).close()
    assert stages.peak_rss_mb["large"] > base + 300
    assert stages.peak_rss_mb["small"] < stages.peak_rss_mb["large"] - 300
    assert stages.overall_rss_mb >= stages.peak_rss_mb["large"]
