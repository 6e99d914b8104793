"""Run a GGUF in llama.cpp's own tools and read back what they measure.

The binaries come from `make engines` (llama.cpp built from the llama-cpp-python sdist into
~/.cache/transmla-tool/engines/llama.cpp/build/bin; `TRANSMLA_LLAMA_CPP_BIN` points elsewhere):
llama-perplexity (perplexity and the KV cache it allocated), llama-bench (decode tokens/s at a depth),
llama-simple (greedy text) and llama-quantize.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

from ..errors import UserError
from .process import run_child
from .vllm_engine import ENGINES_DIR


def llama_cpp_bin(tool: str) -> Path:
    directory = Path(os.environ.get("TRANSMLA_LLAMA_CPP_BIN", ENGINES_DIR / "llama.cpp" / "build" / "bin"))
    path = directory / tool
    if not path.exists():
        raise UserError(f"no {tool} in {directory}; run `make engines` (or set TRANSMLA_LLAMA_CPP_BIN to a "
                        "llama.cpp build/bin directory)")
    return path


def llama_cpp_version() -> str:
    """The llama.cpp that runs: the binary's own version line, and the source it was built from when
    `make engines` recorded it (SOURCE beside the build)."""
    run = run_child([llama_cpp_bin("llama-perplexity"), "--version"], capture_output=True, text=True, timeout=60,
                    stdin=subprocess.DEVNULL)
    line = next((ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("version:")), "version: unknown")
    source = llama_cpp_bin("llama-perplexity").parents[2] / "SOURCE"
    built_from = f" from {source.read_text().strip()}" if source.exists() else ""
    return f"llama.cpp {line.removeprefix('version:').strip()}{built_from}"


def _run(cmd: list, timeout: int = 3600) -> str:
    """Run a llama.cpp tool; its output goes through a file, not a pipe (seen here: with pipes
    llama-perplexity's asynchronous logger lost the lines after the first chunk, final estimate included)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as log:
        run = run_child(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                        timeout=timeout)
        log.seek(0)
        text = log.read()
    if run.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-12:])
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed (exit {run.returncode}):\n{tail}")
    return text


# what llama.cpp's -ctk/-ctv accept (common/arg.cpp of the llama-cpp-python 0.3.36 sdist)
LLAMA_CPP_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def split_types(entry: str) -> tuple[str, str]:
    """A cache type entry, "q4_0" or "K/V" such as "q8_0/q4_0", as (K type, V type)."""
    k, _, v = entry.partition("/")
    return k, v or k


def cache_flags(entry: str) -> list[str]:
    """llama.cpp flags for a cache type: flash attention on (a quantized V cache needs it, and every type is
    measured the same way)."""
    k, v = split_types(entry)
    return ["-fa", "on", "-ctk", k, "-ctv", v]


def perplexity_per_cache_type(gguf, text_file, ctx: int, chunks: int, entries: list[str],
                              flags: list | None = None) -> dict:
    """{entry: {"perplexity", "bytes"}}: llama-perplexity under each cache type, and the bytes per token per
    layer it allocated."""
    out = {}
    for entry in entries:
        measured = perplexity(gguf, text_file, ctx, chunks, flags=[*(flags or []), *cache_flags(entry)])
        out[entry] = {"perplexity": measured["perplexity"], "bytes": measured["kv_bytes_per_token_per_layer"],
                      "chunks": measured["chunks"], "cpu_kernels": measured["cpu_kernels"]}
    return out


def threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def perplexity(gguf: str | Path, text_file: str | Path, ctx: int, chunks: int, flags: list | None = None) -> dict:
    """llama-perplexity over `chunks` windows of `ctx` tokens (it scores the second half of each):
    perplexity, and the KV cache it allocated per token per layer (one sequence of ctx cells)."""
    for _attempt in range(4):
        # seen with this build on tiny models: now and then it exits 0 after the second-to-last chunk,
        # without the final estimate; such a run is repeated, never read
        log = _run([llama_cpp_bin("llama-perplexity"), "-m", gguf, "-f", text_file, "-c", ctx, "-b", ctx,
                    "--chunks", chunks, "-t", threads(), "-lv", "4", *(flags or [])])
        final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
        if final:
            break
    cache = re.search(r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers", log)
    scored = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not final or not cache:
        raise RuntimeError(f"could not read llama-perplexity's output for {gguf}:\n" + log[-2000:])
    mib, cells, layers = float(cache.group(1)), int(cache.group(2)), int(cache.group(3))
    return {"perplexity": float(final.group(1)), "chunks": int(scored.group(1)) if scored else chunks,
            "kv_cache_mib": mib, "kv_cells": cells, "kv_layers": layers,
            "kv_bytes_per_token_per_layer": mib * 2**20 / (cells * layers), "cpu_kernels": cpu_kernels(log)}


def cpu_kernels(log: str) -> str:
    """The CPU features the running llama.cpp was compiled for, as its system_info line lists them ("SSE3 SSSE3 AVX
    AVX2 ..."). They pick its dot-product kernels, and a quantized cache's perplexity moves with them: SmolLM2 on
    docs under iq4_nl read 10.5351 on one machine's native build and 10.5769 on another's (f16 10.072 on both).
    So every llama.cpp score records them, and scores from different kernels are never put side by side."""
    line = re.search(r"system_info:.*?\| CPU : (.*)$", log, re.MULTILINE)
    if not line:
        return "unknown"
    flags = (part.partition("=") for part in line.group(1).split("|"))
    return " ".join(name.strip() for name, _, value in flags if value.strip() == "1")


def build_label(version: str, kernels: str | list[str] | None) -> str:
    """What scored a llama.cpp number, as every table and report names it: its version line and the CPU kernels it
    ran (one set, or several joined), or the version alone when the kernels were not recorded."""
    if not kernels:
        return version
    return f"{version}, CPU kernels {kernels if isinstance(kernels, str) else ', '.join(kernels)}"


def decode_speed(gguf: str | Path, depth: int, tokens: int = 16, repetitions: int = 3) -> dict:
    # (rope flags do not change the speed; llama-bench takes none)
    """llama-bench: tokens/s generating `tokens` tokens after a context of `depth` tokens."""
    out = _run([llama_cpp_bin("llama-bench"), "-m", gguf, "-p", 0, "-n", tokens, "-d", depth, "-r", repetitions,
                "-t", threads(), "-o", "json"])
    rows = json.loads(out[out.index("["): out.rindex("]") + 1])
    row = next(r for r in rows if r.get("n_gen") == tokens)
    return {"tokens_per_s": row["avg_ts"], "stddev": row.get("stddev_ts"), "depth": depth, "tokens": tokens,
            "build": row.get("build_commit")}


def greedy_text(gguf: str | Path, prompt: str, tokens: int) -> str:
    """The text llama-simple generates greedily after `prompt` (prompt included; it prints the text
    alone on stdout and stops early at an end-of-generation token)."""
    run = run_child([llama_cpp_bin("llama-simple"), "-m", gguf, "-n", tokens, prompt], capture_output=True,
                    text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"llama-simple failed on {gguf}:\n{run.stderr[-1500:]}")
    return run.stdout


def quantize(src: str | Path, dst: str | Path, qtype: str = "Q8_0", keep: dict | None = None,
             allow_requantize: bool = False) -> None:
    """llama-quantize, with per-tensor types kept (e.g. {"attn_kv_a_mqa": "bf16"}); allow_requantize re-types an
    already quantized file (e.g. Q4_1 -> F32 stores the same values dequantized)."""
    extra = [a for name, kind in (keep or {}).items() for a in ("--tensor-type", f"{name}={kind}")]
    extra += ["--allow-requantize"] if allow_requantize else []
    _run([llama_cpp_bin("llama-quantize"), *extra, src, dst, qtype, threads()])


def reference_perplexity(model, ids, ctx: int, chunks: int, bos: int | None = None) -> float:
    """transformers' perplexity computed as llama-perplexity does: consecutive ctx-token chunks of
    `ids` (the whole text tokenized once), each chunk's first token replaced by `bos` when the
    tokenizer adds one, only the second half of each chunk scored."""
    import torch

    nll, count = 0.0, 0
    first = ctx // 2
    with torch.no_grad():
        for i in range(chunks):
            chunk = ids[i * ctx:(i + 1) * ctx].clone().unsqueeze(0)
            if bos is not None:
                chunk[0, 0] = bos
            logits = model(chunk).logits[0].float()
            logp = torch.log_softmax(logits[first:ctx - 1], dim=-1)
            target = chunk[0, first + 1:ctx]
            nll -= logp.gather(1, target.unsqueeze(1)).sum().item()
            count += target.numel()
    return math.exp(nll / count)
