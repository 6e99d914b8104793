"""Write a checkpoint while its tensors are still being produced, in bounded memory, resumably.

Tensors arrive in groups (the embeddings, one decoder layer, the head); each group is written at
once to its own part file under `parts/` (atomically: temporary name, then rename), so memory holds
one group and a killed run can skip the groups already on disk. `close()` assembles the final shards
from the parts, one shard in memory at a time, following the plan of huggingface_hub's splitter run
on the *planned* (meta) state dict, so files and index are exactly what `save_pretrained` would write.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from .staging import ASSEMBLED_MARK

# Memory during assembly is one shard: 2GB keeps an 8B conversion's peak low (save_pretrained's
# 5GB default would dominate it). Pass max_shard_size to change it.
DEFAULT_MAX_SHARD = "2GB"
PARTS = "parts"


def check_shard_size(max_shard_size) -> None:
    """A size huggingface_hub's splitter accepts ('2GB', '500MB', bytes), checked before any work."""
    from ..errors import UserError

    try:
        split_torch_state_dict_into_shards({"probe": torch.zeros(1)}, max_shard_size=max_shard_size)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--max-shard-size {max_shard_size!r}: {exc}") from exc


class ShardedWriter:
    def __init__(self, directory: str | Path, planned: dict[str, torch.Tensor], max_shard_size=DEFAULT_MAX_SHARD):
        self.directory = Path(directory)
        self.parts = self.directory / PARTS
        self.parts.mkdir(parents=True, exist_ok=True)
        self.planned = planned
        self.split = split_torch_state_dict_into_shards(planned, max_shard_size=max_shard_size)

    def has_part(self, part: str) -> bool:
        return (self.parts / f"{part}.safetensors").exists()

    def add_part(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one group of tensors (cast to the planned dtype) as part file `part`."""
        out = {}
        for name, tensor in tensors.items():
            if name not in self.planned:
                raise KeyError(f"tensor {name} is not part of the planned checkpoint")
            expected = self.planned[name]
            if tuple(tensor.shape) != tuple(expected.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != planned {tuple(expected.shape)}")
            out[name] = tensor.detach().to(device="cpu", dtype=expected.dtype).contiguous()
        path = self.parts / f"{part}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(out, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)

    def _part_index(self) -> dict[str, Path]:
        where = {}
        for path in sorted(self.parts.glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise ValueError(f"tensor {name} written twice ({where[name].name}, {path.name})")
                    where[name] = path
        return where

    def close(self) -> list[str]:
        """Assemble the shards (and the index when sharded) and remove the parts. Resumable: each shard is written
        under a temporary name and renamed, and ASSEMBLED_MARK is set once all are there, before any part is
        removed; a run killed here assembles again, or finds the mark and only removes the parts."""
        if not (self.directory / ASSEMBLED_MARK).exists():
            self._assemble()
            (self.directory / ASSEMBLED_MARK).touch()
        shutil.rmtree(self.parts, ignore_errors=True)
        return sorted(self.split.filename_to_tensors)

    def _assemble(self) -> None:
        where = self._part_index()
        missing = sorted(set(self.planned) - set(where))
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        for filename, names in self.split.filename_to_tensors.items():
            shard = {}
            for path in sorted({where[n] for n in names}):
                with safe_open(path, framework="pt") as f:
                    for name in names:
                        if where[name] == path:
                            shard[name] = f.get_tensor(name)
            tmp = self.directory / f"{filename}.tmp"
            save_file(shard, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, self.directory / filename)
            del shard
        if self.split.is_sharded:
            index = {"metadata": dict(self.split.metadata), "weight_map": dict(self.split.tensor_to_filename)}
            tmp = self.directory / "model.safetensors.index.json.tmp"
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            os.replace(tmp, self.directory / "model.safetensors.index.json")
