"""Run a checkpoint in vLLM and report what it computed. Standalone: executed by the Python of vLLM's own
virtual environment (vLLM pins its own transformers), never imported by transmla_tool.

    <vllm-venv>/bin/python vllm_runner.py --model DIR --requests req.json --out result.json

req.json: {"greedy": [[ids], ...], "new_tokens": 32, "perplexity": [[ids], ...],
           "contexts": [[ids], ...], "decode_tokens": 16}
result.json: greedy token ids, summed next-token NLL and token count of the perplexity windows, the KV
cache vLLM allocated (bytes per token, from its own tensors), decode seconds per token at each context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def kv_cache_bytes_per_token(llm) -> dict:
    """Bytes per token per layer of the KV cache tensors vLLM allocated (in-process engine only)."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        caches = runner.kv_caches
        config = core.vllm_config.cache_config
        block = config.block_size
        blocks = config.num_gpu_blocks or config.num_cpu_blocks
        total = sum(t.numel() * t.element_size() for t in caches)
        return {"bytes_total": total, "blocks": blocks, "block_size": block, "layers": len(caches),
                "bytes_per_token_per_layer": total / (blocks * block * len(caches))}
    except Exception as exc:  # internal layout differs between vLLM versions: say so instead of guessing
        return {"error": f"{type(exc).__name__}: {exc}"}


def attention_backend(requested: str, dtype: str) -> str | None:
    """The attention backend to ask vLLM for (None: vLLM's own choice). On a CPU with AMX tiles vLLM 0.32 picks its
    AMX MLA backend for every MLA model, and that backend's weight packing takes bfloat16, float16, int8, fp8 or
    4-bit weights only: an fp32 run dies while loading ("expect weight to be bfloat16, float16, ..."; measured on a
    Sapphire Rapids-class CPU). fp32 runs there take the reference CPU MLA backend, which vLLM also ships."""
    if requested != "auto":
        return requested
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and dtype in ("float32", "float") and torch.cpu._is_amx_tile_supported():
        return "CPU_MLA"  # a model without MLA ignores it (vLLM logs that it cannot use it and takes CPU_ATTN)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, ...)")
    parser.add_argument("--attention-backend", default="auto", help="vLLM's attention backend (auto: see "
                        "attention_backend())")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: its caches are visible

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.load(open(args.requests))
    start = time.time()
    backend = attention_backend(args.attention_backend, args.dtype)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True, seed=0,
              enable_prefix_caching=False, max_num_seqs=8, kv_cache_dtype=args.kv_cache_dtype,
              **({"attention_config": {"backend": backend}} if backend else {}))
    result = {"vllm": vllm.__version__, "load_s": round(time.time() - start, 1),
              "kv_cache": kv_cache_bytes_per_token(llm), "attention_backend": backend or "vLLM's choice"}

    if req.get("greedy"):
        params = SamplingParams(temperature=0.0, max_tokens=req.get("new_tokens", 32), ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["greedy"]], params, use_tqdm=False)
        result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]

    if req.get("perplexity"):
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["perplexity"]], params, use_tqdm=False)
        nll, count = 0.0, 0
        for out, ids in zip(outs, req["perplexity"]):
            for pos in range(1, len(ids)):
                nll -= out.prompt_logprobs[pos][ids[pos]].logprob
                count += 1
        result["nll_sum"], result["nll_tokens"] = nll, count

    timings = {}
    for ids in req.get("contexts", []):
        n = req.get("decode_tokens", 16)
        prompt = [TokensPrompt(prompt_token_ids=ids)]
        short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        long = SamplingParams(temperature=0.0, max_tokens=1 + n, ignore_eos=True)
        for params in (short, long):
            llm.generate(prompt, params, use_tqdm=False)  # warm-up of this shape

        def timed(params):
            t0 = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            return time.perf_counter() - t0

        # decode time = (prefill + 1 + n tokens) - (prefill + 1 token), measured in interleaved pairs so that
        # load on the machine hits both halves of a pair alike; the median of the pairs' differences
        pairs = [(timed(short), timed(long)) for _ in range(5)]
        per_token = statistics.median(b - a for a, b in pairs) / n
        timings[str(len(ids))] = {
            # not positive: the decode time drowned in the noise of the runs (a loaded machine); no speed is
            # reported rather than a meaningless one
            "decode_s_per_token": per_token if per_token > 0 else None,
            "tokens_per_s": 1.0 / per_token if per_token > 0 else None,
            "prefill_s": statistics.median(a for a, _ in pairs)}
    result["decode"] = timings
    json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
