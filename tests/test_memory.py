"""The kernel's peak-RSS readings behind conversion.json's and healing.json's memory figures (Linux)."""

from pathlib import Path

import pytest
import torch

from transmla_tool.memory import Stages, reset_rss_peak, vm_hwm_mb

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")


def _touch(mb: int) -> torch.Tensor:
    return torch.ones(mb * 2**20 // 4)  # written, so resident


def test_reset_lowers_the_peak_to_the_current_rss():
    big = _touch(400)
    before = vm_hwm_mb()
    del big
    reset_rss_peak()
    after = vm_hwm_mb()
    assert after < before - 300, (before, after)


def test_stages_keep_the_overall_peak_across_their_resets():
    """Each stage resets the counter for its own peak; the overall peak (conversion.json's peak_rss_mb) must still see
    a large stage that came before a small one."""
    stages = Stages()
    reset_rss_peak()
    base = vm_hwm_mb()
    with stages("large"):
        big = _touch(400)
        del big
    with stages("small"):
        _touch(8)
    assert stages.peak_rss_mb["large"] > base + 300
    assert stages.peak_rss_mb["small"] < stages.peak_rss_mb["large"] - 300
    assert stages.overall_rss_mb >= stages.peak_rss_mb["large"]
