"""Run a checkpoint in vLLM (its own virtual environment) and compare with transformers.

vLLM pins its own transformers, so it lives in a separate venv (`make engines` puts it in
~/.cache/transmla-tool/engines/vllm; `TRANSMLA_VLLM_PYTHON` points elsewhere). This module only
prepares requests and reads results; `vllm_runner.py` runs inside that venv.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..errors import UserError
from .process import run_child

ENGINES_DIR = Path(os.environ.get("TRANSMLA_ENGINES", Path.home() / ".cache" / "transmla-tool" / "engines"))
RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_python() -> Path:
    path = Path(os.environ.get("TRANSMLA_VLLM_PYTHON", ENGINES_DIR / "vllm" / "bin" / "python"))
    if not path.exists():
        raise UserError(f"no vLLM environment at {path}; run `make engines` (or set TRANSMLA_VLLM_PYTHON to the "
                        "python of a venv with vllm installed)")
    return path


def run_vllm(model: str | Path, *, greedy=None, new_tokens: int = 32, perplexity=None, contexts=None,
             decode_tokens: int = 16, dtype: str = "float32", max_model_len: int = 4096, env: dict | None = None,
             timeout: int = 1800, kv_cache_dtype: str = "auto", attention_backend: str = "auto") -> dict:
    """Run vllm_runner.py on `model`; token id lists in, the runner's JSON result out."""
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req.write_text(json.dumps({"greedy": greedy or [], "new_tokens": new_tokens, "perplexity": perplexity or [],
                                   "contexts": contexts or [], "decode_tokens": decode_tokens}))
        cmd = [str(vllm_python()), str(RUNNER), "--model", str(model), "--requests", str(req), "--out", str(out),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-dtype", kv_cache_dtype,
               "--attention-backend", attention_backend]
        full_env = dict(os.environ, **(env or {}))
        run = run_child(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
        if run.returncode != 0 or not out.exists():
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM failed on {model} (exit {run.returncode}):\n{tail}")
        result = json.loads(out.read_text())
        result["log_tail"] = "\n".join(run.stderr.strip().splitlines()[-40:])
        return result
