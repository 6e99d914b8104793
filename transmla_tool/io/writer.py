"""Write a checkpoint shard by shard while tensors are still being produced.

The shard plan comes from huggingface_hub's splitter run on the *planned* (meta) state dict, so the
files and index are exactly what `save_pretrained` would write; a shard is saved as soon as its last
tensor arrives, so memory holds about one shard, whatever the model size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

DEFAULT_MAX_SHARD = "5GB"


class ShardedWriter:
    def __init__(self, directory: str | Path, planned: dict[str, torch.Tensor], max_shard_size=DEFAULT_MAX_SHARD):
        self.directory = Path(directory)
        self.planned = planned
        self.split = split_torch_state_dict_into_shards(planned, max_shard_size=max_shard_size)
        self.file_of = {t: f for f, names in self.split.filename_to_tensors.items() for t in names}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.written: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.planned:
            raise KeyError(f"tensor {name} is not part of the planned checkpoint")
        expected = self.planned[name]
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != planned {tuple(expected.shape)}")
        filename = self.file_of[name]
        shard = self.pending.setdefault(filename, {})
        if name in shard or name in self.written:
            raise ValueError(f"tensor {name} written twice")
        shard[name] = tensor.detach().to(device="cpu", dtype=expected.dtype).contiguous()
        if len(shard) == len(self.split.filename_to_tensors[filename]):
            save_file(shard, str(self.directory / filename), metadata={"format": "pt"})
            self.written.update(shard)
            del self.pending[filename]

    def close(self) -> list[str]:
        missing = sorted(set(self.planned) - self.written)
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        if self.split.is_sharded:
            index = {"metadata": dict(self.split.metadata), "weight_map": dict(self.split.tensor_to_filename)}
            with open(self.directory / "model.safetensors.index.json", "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        return sorted(self.split.filename_to_tensors)
