"""The healed model written back as a stock DeepSeek-V3 checkpoint (atomically, like convert)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..io.staging import local_paths
from ..io.stock import write_stock_checkpoint
from .settings import HealSettings


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype a converted checkpoint was written in (its config), fp32 when it says nothing."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def export(natural_state: dict, config, settings: HealSettings, tokenizer, summary: dict,
           dtype: torch.dtype = torch.float32) -> None:
    """Write the stock DeepSeek-V3 checkpoint (atomically, like convert)."""
    section = (f"## Healing\n\nFine-tuned for {summary['steps']} steps ({summary['tokens']} tokens) on "
               f"`{settings.data}` with {'distillation from `' + settings.teacher + '`' if settings.teacher else 'the LM loss'}"
               f" (kd_weight {settings.kd_weight}, lm_weight {settings.lm_weight}), training "
               f"{settings.train} parameters; see healing.json." + (
                   f" Trained through a {settings.cache_type} KV cache (quantization-aware healing): serve it "
                   f"with that cache type (e.g. llama.cpp `-ctk {settings.cache_type} -ctv {settings.cache_type}`); "
                   "an exact cache is not what it was fitted for." if settings.cache_type else ""))
    write_stock_checkpoint(natural_state, config, output=settings.output, overwrite=settings.overwrite,
                           tokenizer=tokenizer, source_dir=settings.model, dtype=dtype,
                           records={"healing.json": summary}, sections=[section], kind="heal",
                           inputs=local_paths(settings.model, settings.teacher, settings.data, settings.eval_data))
