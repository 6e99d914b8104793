"""How fast llama.cpp runs a GGUF under each KV-cache type, over the same bindings the benchmarks score with
(engines/llamacpp_lm.py): prefill of a prompt, single-token decode after it, and the benchmark pattern (a prompt's
last tokens removed from the cache and decoded again, as each answer choice of a task is).

    python eval/llamacpp_speed.py --gguf runs/bench/gguf/original-f32.gguf,runs/bench/gguf/mix-docs-r200-qat-iq4_nl-rope32-192-f32.gguf \\
        --cache-types f16,iq4_nl

Each (file, cache type) is timed twice and the second, warm, pass reported. Token ids are a fixed arithmetic run
(speed does not depend on the text). Threads: every CPU this process may use; a GPU build offloads all layers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from transmla_tool.engines.llamacpp_lm import bindings_installed, bindings_version, cpu_kernels, ggml_type  # noqa: E402
from transmla_tool.engines.llamacpp import split_types  # noqa: E402


def time_one(path: str, cache: str, prompt: int, decode: int, suffix: int, repeats: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    k, v = split_types(cache)
    threads = max(1, len(os.sched_getaffinity(0)))
    llm = Llama(model_path=path, n_ctx=prompt + decode + 8, n_batch=512, n_ubatch=512, flash_attn=True,
                type_k=ggml_type(k), type_v=ggml_type(v), n_threads=threads, n_threads_batch=threads, verbose=False,
                n_gpu_layers=-1)
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    ids = [100 + (7 * i) % 5000 for i in range(prompt)]

    def decode_at(tokens: list[int], start: int) -> None:
        for offset in range(0, len(tokens), 512):
            chunk = tokens[offset:offset + 512]
            batch.n_tokens = len(chunk)
            for j, token in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + offset + j, 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = offset + j == len(tokens) - 1
            if llama_cpp.llama_decode(llm._ctx.ctx, batch) != 0:
                raise SystemExit(f"llamacpp_speed.py: llama_decode failed for {path} under {cache}")

    try:
        for _ in range(2):  # the first pass warms up; the second is reported
            llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 0, -1)
            t0 = time.perf_counter()
            decode_at(ids, 0)
            t1 = time.perf_counter()
            for i in range(decode):
                decode_at([5], prompt + i)
            t2 = time.perf_counter()
            for _ in range(repeats):
                llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, prompt - suffix, -1)
                decode_at(ids[prompt - suffix:], prompt - suffix)
            t3 = time.perf_counter()
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()
    return {"prefill_tok_s": prompt / (t1 - t0), "decode_tok_s": decode / (t2 - t1),
            "suffix_tok_s": repeats * suffix / (t3 - t2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="comma-separated GGUF files")
    ap.add_argument("--cache-types", default="f16,iq4_nl")
    ap.add_argument("--prompt", type=int, default=400, help="prompt tokens prefilled")
    ap.add_argument("--decode", type=int, default=20, help="tokens decoded one at a time after the prompt")
    ap.add_argument("--suffix", type=int, default=100, help="last prompt tokens decoded again (the benchmark pattern)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not bindings_installed():
        raise SystemExit("llama.cpp's Python bindings (llama-cpp-python) are not installed; run `make engines`")
    files = [f for f in args.gguf.split(",") if f]
    for f in files:
        if not Path(f).is_file():
            raise SystemExit(f"--gguf: {f} is not a file")
    if not 0 < args.suffix <= args.prompt:
        raise SystemExit("--suffix must be between 1 and --prompt")
    print(f"# llama.cpp speed ({bindings_version()}; CPU kernels {cpu_kernels()}; "
          f"{len(os.sched_getaffinity(0))} threads)\n")
    print(f"| file | cache | prefill {args.prompt} tok/s | decode tok/s | last {args.suffix} again tok/s |")
    print("|---|---|---|---|---|")
    for f in files:
        for cache in args.cache_types.split(","):
            r = time_one(f, cache, args.prompt, args.decode, args.suffix, args.repeats)
            print(f"| {Path(f).name} | {cache} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} "
                  f"| {r['suffix_tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
