"""What each serving engine does with our output, as data, and the verdict for one converted config.

The vLLM and llama.cpp entries were observed by running the engine on this tool's output (vLLM's CPU
build 0.32.0 and llama.cpp from the llama-cpp-python 0.3.36 sdist, on SmolLM2-135M conversions; see
shared/MISSION.md "What the serving engines do"). The SGLang entry was read from the source in its
0.5.23 wheel and was never run (`run_by_us` False): SGLang's CPU path needs its CPU kernels, which no
registry ships (sglang-kernel 0.4.10 holds CUDA sm90/sm100 ops only, no sdist), and no GPU was lent.
Re-check them when targeting another engine version; `tests/test_engines.py`-style runs are the way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineFacts:
    name: str
    version: str
    # latent + rope sizes its MLA path accepts (None: any)
    mla_sizes: tuple[int, ...] | None
    notes: tuple[str, ...] = ()
    run_by_us: bool = True  # False: read from the engine's source only


VLLM = EngineFacts(
    name="vllm",
    version="0.32.0 (CPU build)",
    mla_sizes=(320, 512, 576),
    notes=(
        "the CPU MLA backend accepts 576 (512 + 64) only",
        "any other kv_lora_rank + qk_rope_head_dim dies at the first forward "
        "('Head dimension N is not supported by MLA')",
    ),
)
LLAMA_CPP = EngineFacts(
    name="llama.cpp",
    version="llama-cpp-python 0.3.36 sdist",
    mla_sizes=None,
    notes=(
        "runs the GGUF `transmla-tool export-gguf` writes (architecture deepseek2, MLA over the cached latent): "
        "f32 perplexity within 0.2% of transformers, greedy text equal (tests/test_engines.py)",
        "f16 and every quantized type destroy the tiny linearized kv_a_proj_with_mqa rows unless that "
        "tensor is kept in bf16/f32 (plain Q8_0: perplexity 96,220 vs 54.0)",
        "its deepseek2 loader ignores the GGUF's YaRN beta keys (uses 32 / 1)",
    ),
)


SGLANG = EngineFacts(
    name="sglang",
    version="0.5.23 (read from its wheel's source, not run)",
    mla_sizes=None,
    run_by_us=False,
    notes=(
        "default MLA backend: fa3 on Hopper, trtllm_mla on Blackwell (sm100), triton elsewhere "
        "(arg_groups/model_override_base.get_default_attn_backend, model_overrides/deepseek_v2)",
        "fa3 runs MLA as flash_attn_with_kvcache(q=rope part, qv=latent part): FlashAttention-3 accepts a "
        "Q/K head dim <= 64 with a V head dim <= 512 (sizes multiple of 8; V > 256 needs fp16/bf16)",
        "the triton decode kernel has a generic path for any latent + rope (decode_attention.py)",
        "the Blackwell default trtllm_mla was not read far enough to state its sizes: pass "
        "--attention-backend triton when it refuses a size other than 512 + 64",
        "its DeepSeek weight loader skips `.bias` tensors the model has no parameter for, as vLLM's does",
        "every rope type other than 'default' becomes deepseek_yarn, as in vLLM",
    ),
)
SGLANG_MAX_LATENT, SGLANG_MAX_ROPE = 512, 64  # FlashAttention-3 (SGLang's Hopper default) limits


TARGETS = ("auto", "vllm", "sglang", "llamacpp", "transformers")


def check_target(config, target: str) -> list[str]:
    """Problems that keep `target` from serving a checkpoint with this config, known before converting.
    Raises nothing: the caller decides whether a problem stops the conversion."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}")
    if target == "transformers":
        return []
    if target == "llamacpp":  # any latent size (llama.cpp's deepseek2 only needs a non-empty nope part)
        problems = ["attention biases: llama.cpp's deepseek2 has no attention bias tensors"] if config.attention_bias else []
        return problems + _activation_problems(config, "llama.cpp's deepseek2")
    if target == "sglang":
        return servability(config)["sglang"]["problems"]
    return servability(config)["vllm"]["problems"]


def sglang_size_ok(latent: int, rope: int) -> bool:
    """SGLang's Hopper default (FlashAttention-3 MLA) takes these sizes, as read in its source; not run."""
    return latent <= SGLANG_MAX_LATENT and rope <= SGLANG_MAX_ROPE and latent % 8 == 0 and rope % 8 == 0


def _sglang_problems(config, rope_type: str) -> list[str]:
    """What SGLang 0.5.23 would get wrong or refuse, as read from its source (never run here)."""
    latent, rope = config.kv_lora_rank, config.qk_rope_head_dim
    problems = []
    if not sglang_size_ok(latent, rope):
        problems.append(
            f"latent {latent} + rope {rope}: SGLang's Hopper default (FlashAttention-3 MLA) takes a latent <= "
            f"{SGLANG_MAX_LATENT} and a rope part <= {SGLANG_MAX_ROPE}, both multiples of 8 (read in its source); "
            "its triton backend (--attention-backend triton) has no size limit")
    if config.attention_bias:
        problems.append("attention biases: SGLang's DeepSeek loader skips them silently (read in its source), "
                        "so it would serve a different model")
    problems += _activation_problems(config, "SGLang (read in its source)")
    if rope_type not in ("default", "yarn"):
        problems.append(f"rope_type '{rope_type}': SGLang turns it into DeepSeek YaRN (read in its source)")
    return problems


def _activation_problems(config, engine: str) -> list[str]:
    act = getattr(config, "hidden_act", "silu")
    if act == "silu":
        return []
    return [f"hidden_act '{act}' (Gemma's GeGLU): {engine} applies SiLU in every DeepSeek MLP, so it would serve "
            "a different model; the checkpoint is exact in transformers only"]


def llamacpp_cache_note(config) -> str | None:
    """What llama.cpp's quantized caches make of a converted config's sizes: None when every type fits."""
    from ..ops.kv_quant import BLOCK, mla_cache_problem

    latent, rope = config.kv_lora_rank, config.qk_rope_head_dim
    if mla_cache_problem("q8_0", latent, rope) is None:
        return None
    fixes = [f"--pad-latent-to {-(-latent // BLOCK) * BLOCK} (exact)"] if latent % BLOCK else []
    fixes += [f"--rope-dim {BLOCK} or {2 * BLOCK}"] if rope % BLOCK else []
    return (f"latent {latent} + rope {rope}: llama.cpp runs it with an f16, bf16 or f32 cache only; its quantized "
            f"cache types (-ctk q8_0, q4_0, iq4_nl, ...) need a latent and a rotary key that are multiples of {BLOCK} "
            f"({' and '.join(fixes)})")


def servability(config) -> dict:
    """Per-engine verdict for a converted DeepSeek-V3 config: what is known to work and what not."""
    size = config.kv_lora_rank + config.qk_rope_head_dim
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    vllm_problems = []
    if size not in VLLM.mla_sizes:
        vllm_problems.append(
            f"latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim} = {size}: vLLM {VLLM.version} serves "
            f"MLA only at {'/'.join(map(str, VLLM.mla_sizes))} (CPU backend: 576) and fails at the first forward")
    if config.attention_bias:
        vllm_problems.append(
            "attention biases (from the source's q/k/v biases): vLLM's DeepSeek attention has no bias parameters "
            "and its loader skips them silently, so it would serve a different model")
    if rope_type == "default":
        vllm_problems.append(
            "rope_type 'default': vLLM's CPU rotary kernel computes DeepSeek's 3-D q/k slices wrongly "
            "(perplexity 464 instead of 34 measured); this tool writes YaRN with factor 1 instead, which is exact")
    elif rope_type != "yarn":
        vllm_problems.append(
            f"rope_type '{rope_type}': vLLM turns every non-default rope type on a DeepSeek model into DeepSeek "
            "YaRN, which is not this model's rotary embedding (--target vllm maps Llama-3 scaling onto YaRN)")
    vllm_problems += _activation_problems(config, f"vLLM {VLLM.version}")
    # rope_type 'yarn' is what vLLM computes too (tests/test_engines.py runs factor 1 and a Llama-3 mapping)
    llama_problems = [
        "not loadable from this checkpoint directly: write a GGUF with `transmla-tool export-gguf` (keeps "
        "attn_kv_a_mqa in f32), then quantize with `llama-quantize --tensor-type attn_kv_a_mqa=bf16 in.gguf "
        "out.gguf Q8_0` (Q8_0 within 2% of f32 measured; a plain quantize destroys the latent projection)",
    ]
    scaled = rope_type == "yarn" and float((config.rope_parameters or {}).get("factor") or 1.0) != 1.0
    if scaled:
        llama_problems.append(
            "YaRN rope: llama.cpp's deepseek2 loader ignores the ramp stored in the GGUF; pass the "
            "--yarn-beta-fast/--yarn-beta-slow values export-gguf prints")
    cache_note = llamacpp_cache_note(config)
    if cache_note:
        llama_problems.append(cache_note)
    if config.attention_bias:
        llama_problems.append("attention biases: not checked in llama.cpp")
    llama_problems += _activation_problems(config, f"llama.cpp {LLAMA_CPP.version}")
    return {
        "transformers": "exact (AutoModelForCausalLM, no trust_remote_code)",
        "vllm": {"version": VLLM.version, "serves_as_is": not vllm_problems, "problems": vllm_problems},
        # "as is" = from this directory without another step; the exported GGUF runs (see problems)
        "llama.cpp": {"version": LLAMA_CPP.version, "serves_as_is": False, "problems": llama_problems},
        # read from SGLang's source, never run: `serves_as_is` is what its code implies, not an observation
        "sglang": {"version": SGLANG.version, "serves_as_is": not _sglang_problems(config, rope_type),
                   "problems": _sglang_problems(config, rope_type), "run": False},
        # kept for readers of older conversion.json files: true only when vLLM serves it as is
        "vllm_sglang_as_is": not vllm_problems,
        "notes": vllm_problems + llama_problems
        + [f"SGLang (read from its source, not run): {problem}" for problem in _sglang_problems(config, rope_type)],
    }


ENGINE_TARGETS = ("vllm", "sglang", "llamacpp")  # targets that want bias-free output and Llama-3 scaling as YaRN


def drops_biases(target: str, biases: str) -> bool:
    """Does `convert --target T --biases B` write a bias-free output?"""
    from ..errors import UserError

    if biases not in ("auto", "keep", "drop"):
        raise UserError(f"--biases must be auto, keep or drop, got {biases}")
    return biases == "drop" or (biases == "auto" and target in ENGINE_TARGETS)


def check_engines(configs: dict, target: str, rope_dim: int, *, refuse: bool = True, progress: bool = True) -> None:
    """Say before converting which engines will refuse the outputs ({latent dim: config}); refuse them for an
    engine target unless `refuse` is off (then each first problem is printed)."""
    from ..errors import UserError

    for latent_dim, config in configs.items():
        cache_note = llamacpp_cache_note(config) if target in ("llamacpp", "auto") else None
        if cache_note and progress:  # served all the same (f16 cache): said, never refused
            print(f"note (llama.cpp, latent {latent_dim}): {cache_note}")
        problems = check_target(config, target)
        if not problems:
            continue
        if not refuse:
            if progress:
                print(f"note (--target {target}, latent {latent_dim}): {problems[0]}")
            continue
        size = config.kv_lora_rank + config.qk_rope_head_dim
        if target == "llamacpp":
            raise UserError(f"--target llamacpp: {problems[0]}; pass --biases drop (or --target transformers)")
        if target == "sglang":
            raise UserError(f"--target sglang: {problems[0]}; choose --latent-dim <= {SGLANG_MAX_LATENT} and --rope-dim "
                            f"<= {SGLANG_MAX_ROPE} (multiples of 8), --biases drop, or --target transformers")
        if target == "vllm":
            fix = (f"choose --latent-dim so latent + rope is one of {'/'.join(map(str, VLLM.mla_sizes))}, or "
                   f"--pad-latent-to {min(s for s in VLLM.mla_sizes if s >= size) - rope_dim}"
                   if size not in VLLM.mla_sizes and size <= max(VLLM.mla_sizes) else "")
            raise UserError(f"--target vllm: {problems[0]}" + (f"; {fix}" if fix else "")
                            + "; or pass --target transformers to convert anyway")
        for problem in problems if progress else []:
            print(f"note (vLLM {VLLM.version}, latent {config.kv_lora_rank}): {problem}")
