"""Where and in what precision the work runs: one resolution of --device and --dtype for convert, eval,
sweep and the benchmark scripts."""

from __future__ import annotations

import torch

from .errors import UserError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} requested but no CUDA device is available; use --device cpu")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"--device must be cpu, cuda, cuda:N or auto, got {name}")
    return torch.device(name)


def resolve_dtype(name: str, src_config) -> torch.dtype:
    if name in ("float16", "fp16", "half"):
        raise UserError(
            "--dtype float16 cannot represent the linearized latent RMSNorm (its tiny activations fall "
            "into fp16's subnormal range); use --dtype bfloat16 or float32"
        )
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if name in table:
        return table[name]
    if name != "auto":
        raise UserError(f"--dtype must be auto, bfloat16 or float32, got {name}")
    src = getattr(src_config, "dtype", None)  # transformers 5 reads an old `torch_dtype` key into `dtype`
    if isinstance(src, str):
        src = getattr(torch, src, None)
    if src == torch.float16:
        return torch.bfloat16  # fp16 cannot hold the linearized norm; bf16 keeps the memory footprint
    return src if src in (torch.bfloat16, torch.float32) else torch.float32



def resolve_eval_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise UserError(f"--dtype must be auto, bfloat16 or float32 for eval, got {name}")
    return table[name]
