"""Resumable healing checkpoints: what is saved per step and how a run continues from it.

A checkpoint directory `step-N` is complete when its trainer_state.json exists (written last). Without
sharding (one process, DDP) it holds the trainable parameters, optimizer and scheduler state and each
process's RNG state; FSDP and DeepSpeed use accelerate's own save_state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

STATE_FILE = "trainer_state.json"


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((p for p in directory.glob("step-*") if (p / STATE_FILE).exists()),
                   key=lambda p: int(p.name.split("-")[1]))
    return found[-1] if found else None


LEAN_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")  # every process holds the whole model: save only what trains


def _lean(accelerator) -> bool:
    return accelerator.distributed_type.name in LEAN_TYPES


def save_checkpoint(accelerator, path: Path, state: dict, model, optimizer, scheduler,
                    total_limit: int | None = None) -> None:
    """A resumable checkpoint. Without sharding (one process, DDP) it holds the trainable parameters,
    optimizer and scheduler state and each process's RNG state: the frozen weights are the converted
    checkpoint's and are not copied again. FSDP and DeepSpeed shard parameters and optimizer state:
    there accelerate's own save_state writes each process's shards."""
    import random

    import numpy as np
    from safetensors.torch import save_file

    if not _lean(accelerator):
        accelerator.save_state(str(path))
    else:
        path.mkdir(parents=True, exist_ok=True)
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            trainable = {n: p.detach().cpu().contiguous() for n, p in unwrapped.named_parameters() if p.requires_grad}
            save_file(trainable, str(path / "trainable.safetensors"))
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       path / "optimizer.pt")
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, path / f"rng-{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps(state))  # written last: marks the checkpoint complete
        if total_limit:
            done = sorted((p for p in path.parent.glob("step-*") if (p / STATE_FILE).exists()),
                          key=lambda p: int(p.name.split("-")[1]))
            for old in done[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, path: Path, model, optimizer, scheduler) -> None:
    import random

    import numpy as np
    from safetensors.torch import load_file

    if not (path / "trainable.safetensors").exists():
        accelerator.load_state(str(path))
        return
    unwrapped = accelerator.unwrap_model(model)
    trainable = load_file(path / "trainable.safetensors")
    params = dict(unwrapped.named_parameters())
    with torch.no_grad():
        for name, value in trainable.items():
            params[name].copy_(value)
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng = torch.load(path / f"rng-{accelerator.process_index}.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
