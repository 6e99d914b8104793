"""Write a natural-form model back as a stock DeepSeek-V3 checkpoint (atomically, like convert).

Shared by `heal` and `rebalance`: both change a converted checkpoint's attention in its natural form
(heal/model.py) and hand it back in the stock form every engine loads, with the source's tokenizer,
generation config, conversion record and a model card that says what was done to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .staging import staged_directory

RECORDS = ("conversion.json", "healing.json", "rebalance.json")  # what a checkpoint says was done to it


def write_stock_checkpoint(natural_state: dict, config, *, output: str, overwrite: bool, tokenizer, source_dir: str,
                           dtype: torch.dtype, records: dict[str, dict], sections: list[str], kind: str,
                           inputs: list[Path] = ()) -> None:
    """Write the stock checkpoint of `natural_state` to `output`: the source's records are carried over, the ones
    in `records` (file name -> content) written or replaced, and `sections` appended to the model card."""
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    from ..heal.model import stock_state_dict
    from ..model_card import write_model_card

    state = stock_state_dict(natural_state, config)
    config.dtype = dtype
    with torch.device("meta"):
        stock = DeepseekV3ForCausalLM(config)
    stock.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    stock.config.use_cache = True
    carried = {name: json.loads((Path(source_dir) / name).read_text())
               for name in RECORDS if (Path(source_dir) / name).exists()}
    carried.update(records)
    with staged_directory(output, overwrite, kind=kind, inputs=list(inputs)) as staging:
        stock.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            GenerationConfig.from_pretrained(source_dir).save_pretrained(staging)
        except OSError:
            pass
        for name, content in carried.items():
            (Path(staging) / name).write_text(json.dumps(content, indent=2, default=str))
        if "conversion.json" in carried:
            write_model_card(Path(staging), carried["conversion.json"], stock.config, extra_sections=sections)
