"""The healed model written back as a stock DeepSeek-V3 checkpoint (atomically, like convert)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..io.staging import staged_directory
from .model import stock_state_dict
from .settings import HealSettings


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype a converted checkpoint was written in (its config), fp32 when it says nothing."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def export(natural_state: dict, config, settings: HealSettings, tokenizer, summary: dict,
           dtype: torch.dtype = torch.float32) -> None:
    """Write the stock DeepSeek-V3 checkpoint (atomically, like convert)."""
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    from ..model_card import write_model_card

    state = stock_state_dict(natural_state, config)
    config.dtype = dtype
    with torch.device("meta"):
        stock = DeepseekV3ForCausalLM(config)
    stock.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    stock.config.use_cache = True
    with staged_directory(settings.output, settings.overwrite) as staging:
        stock.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            GenerationConfig.from_pretrained(settings.model).save_pretrained(staging)
        except OSError:
            pass
        source_summary = Path(settings.model) / "conversion.json"
        conversion = json.loads(source_summary.read_text()) if source_summary.exists() else None
        (Path(staging) / "healing.json").write_text(json.dumps(summary, indent=2, default=str))
        if conversion is not None:
            (Path(staging) / "conversion.json").write_text(json.dumps(conversion, indent=2))
            section = (f"## Healing\n\nFine-tuned for {summary['steps']} steps ({summary['tokens']} tokens) on "
                       f"`{settings.data}` with {'distillation from `' + settings.teacher + '`' if settings.teacher else 'the LM loss'}"
                       f" (kd_weight {settings.kd_weight}, lm_weight {settings.lm_weight}), training "
                       f"{settings.train} parameters; see healing.json." + (
                           f" Trained through a {settings.cache_type} KV cache (quantization-aware healing): serve it "
                           f"with that cache type (e.g. llama.cpp `-ctk {settings.cache_type} -ctv {settings.cache_type}`); "
                           "an exact cache is not what it was fitted for." if settings.cache_type else ""))
            write_model_card(Path(staging), conversion, stock.config, extra_sections=[section])
