"""What every evaluation path shares: loading a model or tokenizer, the scoring protocol's checks, long contexts
of real text, and the fields every backend's result starts with."""

from __future__ import annotations

import torch

from ..errors import UserError
from .cache import cached_values_per_token_per_layer


def check_scoring(batch_size: int, seq_len: int, max_tokens: int) -> None:
    """The perplexity protocol's numbers, checked before any model is loaded."""
    if batch_size < 1:
        raise UserError(f"--eval-batch-size must be >= 1, got {batch_size}")
    if seq_len < 2:
        raise UserError(f"--seq-len must be >= 2 (a window scores its tokens after the first), got {seq_len}")
    if max_tokens < seq_len:
        raise UserError(f"--max-tokens {max_tokens} is less than one window of --seq-len {seq_len}")


def load_model(path: str, gguf_file: str | None, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # accelerate places the weights directly on the GPU
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise UserError(f"cannot load model {path}: {exc}") from exc
    return model.to(device).eval()


def load_tokenizer(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    from ..gguf_tokenizer import load_gguf_tokenizer

    try:
        return load_gguf_tokenizer(path, gguf_file) if gguf_file else AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise UserError(f"cannot load the tokenizer of {path}: {exc}") from exc


def context_ids(windows: torch.Tensor, length: int) -> torch.Tensor:
    """(1, length) real-text ids for a long context, cycling the evaluation windows as needed."""
    flat = windows.reshape(-1)
    reps = -(-length // flat.numel())
    return flat.repeat(reps)[:length][None]


def model_entry(path: str, gguf_file: str | None, config, parameters: int | None = None) -> dict:
    """The fields every backend's result starts with (the shape `run_eval` reports)."""
    return {
        "model": path if not gguf_file else f"{path}/{gguf_file}",
        "model_type": config.model_type,
        "parameters": parameters,
        "values_per_token_per_layer": cached_values_per_token_per_layer(config),
        "num_layers": config.num_hidden_layers,
    }
