"""The benchmark scripts under eval/ run end to end on a tiny converted model (their numbers are
benchmarks, not tested here; that they run and check what they claim to check is)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_decode_runs_and_checks_paths(make_model, convert_tiny, dtype):
    out, _, _ = convert_tiny(make_model("llama", heads=4, kv_heads=2, head_dim=16), latent_dim=24, rope_dim=8,
                             target="transformers")
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "mla_decode.py"), "--converted", str(out),
                          "--contexts", "64,256", "--repeats", "2", "--device", "cpu", "--dtype", dtype],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 64 |") or line.startswith("| 256 |")]
    assert len(rows) == 2, run.stdout
    # cache bytes: GQA holds 2 KV heads x (16 + 16) per token, MLA latent 24 + rope (bf16 bytes)
    cells = rows[1].strip("|").split("|")
    assert int(cells[4]) == 2 * 2 * 16 * 256 * 2
