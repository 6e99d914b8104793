"""`transmla-tool export-gguf`: a converted checkpoint as a llama.cpp GGUF (architecture deepseek2).

Written with the `gguf` library, tensor layout as llama.cpp's own DeepSeek converter writes it:
kv_b_proj is split per head into attn_k_b (transposed: latent -> nope key) and attn_v_b, so llama.cpp
runs MLA over the cached latent. Facts the loader needs (llama.cpp src/models/deepseek2.cpp):
head_count_kv 1, key_length = latent + rope and value_length = latent (the cache row),
key_length_mla / value_length_mla the per-head sizes, q_lora_rank present (0 = plain attn_q),
leading_dense_block_count = all layers (no MoE), expert_feed_forward_length and
expert_shared_count present, no expert group keys (n_expert_groups < n_expert is asserted).

The linearized latent norm makes kv_a_proj_with_mqa's latent rows tiny (~1e-6): they underflow f16
and the f16 block scales of every quantized type, so attn_kv_a_mqa is always kept in f32 (or bf16
for a bf16 file), and the quantize command we print keeps it in bf16.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .errors import UserError
from .gguf_tokenizer import LLAMA_CPP_PRE_TOKENIZERS, write_tokenizer
from .io.gguf_fields import field_text
from .io.staging import local_paths, staged_file
from .provenance import read_record

OUTTYPES = ("f32", "bf16", "f16", "q8_0")
# tensors too small in magnitude for f16 or quantized blocks (see module doc)
KEEP_PRECISE = ("attn_kv_a_mqa",)
QUANTIZE_HINT = "llama-quantize --tensor-type attn_kv_a_mqa=bf16 {src} {dst} Q8_0"
OUR_KEY = "transmla_tool.version"  # metadata key marking a GGUF this tool wrote (llama.cpp ignores unknown keys)
# what conversion.json says the checkpoint was converted from, so that a GGUF scored beside an original can be checked
SOURCE_KEYS = {"source_identity": "transmla_tool.source_identity", "source": "transmla_tool.source"}
REQUIRED_CONFIG = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
                   "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings",
                   "rms_norm_eps")


@dataclass
class GGUFSettings:
    checkpoint: str
    output: str
    outtype: str = "f32"
    tokenizer_gguf: str | None = None  # copy tokenizer.* metadata from this GGUF (default: the source's)
    tokenizer_pre: str | None = None  # llama.cpp pre-tokenizer name when building the vocab from tokenizer.json
    overwrite: bool = False


def export_gguf(settings: GGUFSettings) -> dict:
    import gguf

    ckpt = Path(settings.checkpoint)
    config = _read_config(ckpt)
    if settings.outtype not in OUTTYPES:
        raise UserError(f"--outtype {settings.outtype} is not one of {', '.join(OUTTYPES)}")
    out = Path(settings.output)
    if out.suffix != ".gguf":
        raise UserError(f"--output {out} must end in .gguf")
    if settings.tokenizer_pre is not None and settings.tokenizer_pre not in LLAMA_CPP_PRE_TOKENIZERS:
        raise UserError(f"--tokenizer-pre {settings.tokenizer_pre!r} is not a pre-tokenizer llama.cpp knows (it would "
                        "refuse the file); use one of: llama-bpe (Llama 3), qwen2, smollm, gpt-2, ... (see "
                        "LLAMA_CPP_PRE_TOKENIZERS in transmla_tool/gguf_tokenizer.py)")
    tokenizer_source = _tokenizer_source(ckpt, settings)
    inputs = local_paths(str(ckpt), tokenizer_source)
    with staged_file(out, settings.overwrite, inputs, is_ours=written_by_us) as partial:
        writer = gguf.GGUFWriter(partial, "deepseek2")
        try:
            _write_metadata(writer, config, settings.outtype, ckpt.name)
            writer.add_string(OUR_KEY, __version__)
            record = read_record(ckpt)
            for field, key in SOURCE_KEYS.items():
                if record.get(field):
                    writer.add_string(key, str(record[field]))
            write_tokenizer(writer, ckpt, tokenizer_source, settings.tokenizer_pre, config["vocab_size"])
            tensors = _write_tensors(writer, ckpt, config, settings.outtype)
        finally:
            writer.close()
    return {"output": str(out), "outtype": settings.outtype, "tensors": tensors, "run_flags": run_flags(config),
            "bytes": out.stat().st_size, "tokenizer": tokenizer_source or "tokenizer.json",
            "quantize": QUANTIZE_HINT.format(src=out, dst=out.with_name(out.stem + "-Q8_0.gguf"))}


def written_by_us(path: Path) -> bool:
    """Does the GGUF at `path` carry the key export-gguf writes (so --overwrite may replace it)?"""
    from gguf import GGUFReader

    try:
        return OUR_KEY in GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001 -- unreadable: not ours to replace
        return False


def source_record(path: Path) -> dict:
    """What a GGUF export-gguf wrote says of the model it was converted from ({} when it says nothing: another
    tool's file, or one exported before the keys existed)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {field: field_text(fields[key]) for field, key in SOURCE_KEYS.items() if key in fields}


def run_flags(config: dict) -> list[str]:
    """Flags llama.cpp needs at run time for what the GGUF cannot carry: its deepseek2 loader ignores
    the YaRN beta keys (observed: llama-cpp-python 0.3.36 sdist uses 32 / 1), so the fitted ramp of a
    Llama-3 mapping must be passed to llama-cli / llama-server / llama-perplexity."""
    rope = _rope(config)
    if rope.get("rope_type") != "yarn" or float(rope.get("factor") or 1.0) == 1.0:
        return []
    fast, slow = float(rope.get("beta_fast", 32.0)), float(rope.get("beta_slow", 1.0))
    return [] if (fast, slow) == (32.0, 1.0) else ["--yarn-beta-fast", repr(fast), "--yarn-beta-slow", repr(slow)]


def _read_config(ckpt: Path) -> dict:
    path = ckpt / "config.json"
    if not path.exists():
        raise UserError(f"{ckpt} has no config.json; pass the directory `transmla-tool convert` wrote")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); pass the directory `transmla-tool convert` wrote") from exc
    if not isinstance(config, dict):
        raise UserError(f"{path} does not hold a JSON object; pass the directory `transmla-tool convert` wrote")
    if config.get("model_type") != "deepseek_v3":
        raise UserError(f"{ckpt} is a {config.get('model_type')} model, not a converted deepseek_v3 checkpoint")
    if config.get("attention_bias"):
        raise UserError(f"{ckpt} has attention biases, which llama.cpp's deepseek2 ignores; convert with "
                        "--biases drop (or --target vllm) for an engine checkpoint")
    if config.get("hidden_act", "silu") != "silu":
        raise UserError(f"{ckpt} has hidden_act '{config['hidden_act']}' (Gemma's GeGLU), but llama.cpp's deepseek2 "
                        "applies SiLU in every MLP; this checkpoint runs exactly in transformers only")
    missing = [key for key in REQUIRED_CONFIG if config.get(key) is None]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; it was not written by `transmla-tool convert`")
    if config.get("first_k_dense_replace", 0) < config["num_hidden_layers"]:
        raise UserError(f"{ckpt} has MoE layers; export-gguf handles the all-dense checkpoints convert writes")
    return config


def _tokenizer_source(ckpt: Path, settings: GGUFSettings) -> str | None:
    """The GGUF whose tokenizer metadata is copied, or None to build it from tokenizer.json."""
    if settings.tokenizer_gguf:
        if not Path(settings.tokenizer_gguf).is_file():
            raise UserError(f"--tokenizer-gguf {settings.tokenizer_gguf} does not exist")
        return settings.tokenizer_gguf
    if settings.tokenizer_pre:
        return None
    source = str(read_record(ckpt).get("source", ""))
    if source.endswith(".gguf") and Path(source).is_file():
        return source
    raise UserError("name the tokenizer llama.cpp should use: --tokenizer-gguf <a GGUF of the source model>, or "
                    "--tokenizer-pre <llama.cpp pre-tokenizer> (llama-bpe for Llama 3, qwen2, smollm, gpt-2, ...) "
                    "to build it from tokenizer.json")


def _rope(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _write_metadata(writer, config: dict, outtype: str, name: str) -> None:
    import gguf

    rope = _rope(config)
    layers, latent, dr = config["num_hidden_layers"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA: one latent "head" is cached
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_leading_dense_block_count(layers)
    writer.add_q_lora_rank(config.get("q_lora_rank") or 0)
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + dr)
    writer.add_value_length(latent)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + dr)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    writer.add_expert_shared_count(0)
    writer.add_rope_dimension_count(dr)
    factor = float(rope.get("factor") or 1.0)
    if rope.get("rope_type") == "yarn" and factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        # llama.cpp reads this key divided by 0.1 for deepseek2
        mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)
        if not mscale_all_dim:
            # what convert writes (mscale = mscale_all_dim = 0, attention_factor 1: no magnitude change in
            # transformers). llama.cpp multiplies the rotary q/k by attn_factor * (1 + 0.1 ln s) and, with a
            # zero log_mul, the scores by (attn_factor * (1 + 0.1 ln s))^2: attn_factor 1 / (1 + 0.1 ln s)
            # makes both 1 (checked in tests/test_engines.py against transformers)
            attention = float(rope.get("attention_factor") or 1.0)
            writer.add_rope_scaling_attn_factors(attention / (1.0 + 0.1 * math.log(factor)))
    elif rope.get("rope_type") not in (None, "default", "yarn"):
        raise UserError(f"rope type {rope.get('rope_type')} has no deepseek2 GGUF form; convert with --target vllm "
                        "(Llama-3 scaling is then written as DeepSeek YaRN)")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _tensors(ckpt: Path, config: dict):
    """(GGUF name, shape, loader) of every output tensor in file order; nothing is read until a
    loader is called, so the file is written one tensor at a time (a 70B checkpoint never sits in RAM)."""
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config["num_hidden_layers"])
    index = ckpt / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]

    def load(file, hf_name, part=None):
        def read():
            with safe_open(ckpt / file, framework="pt") as f:
                tensor = f.get_tensor(hf_name).float()
            if part is None:
                return tensor
            kv_b = tensor.view(heads, nope + v_dim, -1)  # per head: [nope key rows | value rows] x latent
            return (kv_b[:, :nope].transpose(1, 2) if part == "k" else kv_b[:, nope:]).contiguous()
        return read

    def gguf_name(file, name):
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise UserError(f"{ckpt}/{file}: tensor {name} has no deepseek2 GGUF name")
        return mapped

    for file in files:
        if not (ckpt / file).exists():
            raise UserError(f"{ckpt} is missing {file}; the checkpoint is incomplete")
        with safe_open(ckpt / file, framework="pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        for hf_name, shape in shapes.items():
            if hf_name.endswith("kv_b_proj.weight"):
                latent = shape[1]
                yield (gguf_name(file, hf_name.replace("kv_b_proj", "k_b_proj")), [heads, latent, nope],
                       load(file, hf_name, "k"))
                yield (gguf_name(file, hf_name.replace("kv_b_proj", "v_b_proj")), [heads, v_dim, latent],
                       load(file, hf_name, "v"))
            else:
                yield gguf_name(file, hf_name), shape, load(file, hf_name)


def _kind(name: str, shape: list[int], outtype: str) -> str:
    if len(shape) == 1 or any(key in name for key in KEEP_PRECISE):
        return "bf16" if outtype == "bf16" and len(shape) > 1 else "f32"
    if outtype == "q8_0" and shape[-1] % 32:
        return "f16"  # rows must hold whole Q8_0 blocks
    return outtype


def _encode(tensor: torch.Tensor, kind: str) -> np.ndarray:
    import gguf

    data = tensor.numpy().astype(np.float32)
    if kind == "f32":
        return data
    if kind == "f16":
        return data.astype(np.float16)
    qtype = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(data, qtype)


def _write_tensors(writer, ckpt: Path, config: dict, outtype: str) -> int:
    """Two passes: tensor infos from the safetensors headers, then the data tensor by tensor."""
    import gguf

    raw = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    plan = list(_tensors(ckpt, config))
    for name, shape, _ in plan:
        kind = _kind(name, shape, outtype)
        if kind in raw:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, raw[kind])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=raw[kind])
        else:
            dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, read in plan:
        writer.write_tensor_data(_encode(read(), _kind(name, shape, outtype)))
    return len(plan)
