"""The transformers range pyproject.toml allows is the range CI tests."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_makefile_tests_the_oldest_transformers_pyproject_allows():
    pyproject = (ROOT / "pyproject.toml").read_text()
    lower = re.search(r'"transformers>=([0-9.]+),<([0-9.]+)"', pyproject)
    oldest = re.search(r"^TRANSFORMERS_OLDEST \?= transformers==([0-9.]+)$", (ROOT / "Makefile").read_text(), re.M)
    assert lower and oldest, "pyproject's transformers bound or the Makefile's TRANSFORMERS_OLDEST pin is missing"
    pinned = tuple(int(x) for x in oldest.group(1).split("."))
    bound = tuple(int(x) for x in lower.group(1).split("."))
    assert pinned[: len(bound)] == bound and all(x == 0 for x in pinned[len(bound):]), (pinned, bound)


def test_make_test_runs_the_oldest_suite():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "test-oldest" in recipe


def test_oldest_run_still_serves_a_checkpoint_in_each_engine():
    """The oldest-transformers run selects by marker: it must still pick an engine check of vLLM and of llama.cpp
    (a dropped or renamed `oldest` mark would leave it serving nothing, silently)."""
    import subprocess
    import sys

    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-oldest:", 1)[1].split("\n\n", 1)[0]
    selection = re.search(r'-m "([^"]+)"', recipe)
    assert selection, "test-oldest selects no marker expression"
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", selection.group(1),
                             str(ROOT / "tests" / "test_engines.py")], capture_output=True, text=True, cwd=ROOT)
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    assert any("test_vllm_" in t for t in tests) and any("test_llamacpp_" in t for t in tests), listed.stdout
