"""Exact Llama views of families whose differences from Llama's layout are linear.

`llama_view(source, geometry)` wraps a checkpoint of such a family in a `CheckpointSource` that presents a
Llama config and Llama tensor names, computed tensor by tensor from the source's (so a 70B model is still
read one tensor at a time), such that transformers' Llama forward on the view equals the source family's
own forward (fp32). Everything after (calibration, factorization, export) then sees a Llama model.

- Granite: embeddings times `embedding_multiplier`; each sublayer's output times `residual_multiplier`
  (folded into o_proj and down_proj); the softmax scale `attention_multiplier` instead of head_dim^-1/2
  (folded into q_proj); logits divided by `logits_scaling` (folded into an untied lm_head).
- Phi-3: the fused `qkv_proj` rows are [q | k | v] and `gate_up_proj` rows [gate | up]: split them.
- Gemma 1: RMSNorms multiply by (1 + w): write 1 + w; embeddings times sqrt(hidden) (folded into the input
  embedding, the lm_head keeps the unscaled tied matrix); GeGLU is Llama's gated MLP with hidden_act
  gelu_pytorch_tanh.
"""

from __future__ import annotations

import math

import torch

from ..io.source import CheckpointSource
from .families import EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD

_FLOAT = torch.float32  # folds are computed in fp32 (and the writer casts to the output dtype once)


def llama_view(source: CheckpointSource, geometry) -> CheckpointSource:
    """`source` itself for families already in Llama's layout, else its exact Llama view (geometry: what
    arch.check_supported read from the source's config)."""
    if geometry.family.rewrite is None:
        return source
    return LlamaView(source, geometry)


def llama_config(config, geometry):
    """A LlamaConfig with the source's shapes, rope, eps and activation (the view's folds do the rest)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=geometry.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=geometry.num_layers,
        num_attention_heads=geometry.num_heads,
        num_key_value_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        hidden_act=geometry.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=getattr(config, "initializer_range", 0.02),
        rms_norm_eps=geometry.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
        tie_word_embeddings=False,
    )


class LlamaView(CheckpointSource):
    """A Llama-layout view of a Granite, Phi-3 or Gemma checkpoint; tensors are computed when asked."""

    def __init__(self, inner: CheckpointSource, geometry):
        super().__init__(location=inner.location, config=llama_config(inner.config, geometry),
                         tokenizer_args=inner.tokenizer_args, tokenizer_kwargs=inner.tokenizer_kwargs)
        self.inner = inner
        self.source_config = inner.config
        rules = {"granite": self._granite, "phi3": self._phi3, "gemma": self._gemma}
        self._rule = rules[geometry.family.rewrite]
        self._names = self._view_names()
        self._fused: tuple[str, torch.Tensor] | None = None  # the last fused tensor read (Phi-3 splits it 2-3 ways)

    def _view_names(self) -> set[str]:
        names = {EMBED, FINAL_NORM, LM_HEAD}  # the view is always untied
        for i in range(self.config.num_hidden_layers):
            prefix = LAYER_PREFIX.format(i=i)
            for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                         "post_attention_layernorm"):
                names.add(f"{prefix}{part}.weight")
            if self.config.attention_bias:
                for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    names.add(f"{prefix}self_attn.{part}.bias")
        return names

    def names(self) -> set[str]:
        return self._names

    def _load(self, name: str) -> torch.Tensor:
        tensor = self._rule(name)
        return self.inner.get(self._source_name(name), dtype=None) if tensor is None else tensor

    def _source_name(self, name: str) -> str:
        """The source tensor behind the view's `name`: the view is untied, so a tied source's lm_head is its
        embedding matrix (as stored, before any embedding scale)."""
        return EMBED if name == LM_HEAD and not self.inner.has(LM_HEAD) else name

    def _get(self, name: str) -> torch.Tensor:
        return self.inner.get(self._source_name(name), dtype=_FLOAT)

    def _get_fused(self, name: str) -> torch.Tensor:
        """A fused source tensor, kept until another is read: q, k and v (gate and up) are asked in a row."""
        if self._fused is None or self._fused[0] != name:
            self._fused = (name, self._get(name))
        return self._fused[1]

    # Each rule returns the view's tensor `name`, or None when it is the source's tensor of the same name.

    def _granite(self, name: str) -> torch.Tensor | None:
        cfg = self.source_config
        if name == EMBED:
            return self._get(EMBED) * cfg.embedding_multiplier
        if name == LM_HEAD:
            return self._get(LM_HEAD) / cfg.logits_scaling
        if ".self_attn.q_proj." in name:  # Llama scales scores by head_dim^-1/2; Granite by attention_multiplier
            return self._get(name) * (cfg.attention_multiplier * math.sqrt(self.config.head_dim))
        if ".self_attn.o_proj." in name or name.endswith("mlp.down_proj.weight"):
            return self._get(name) * cfg.residual_multiplier
        return None

    def _phi3(self, name: str) -> torch.Tensor | None:
        cfg = self.config
        layer, sep, part = name.partition(".self_attn.")
        if sep and part.split(".")[0] in ("q_proj", "k_proj", "v_proj"):
            fused = self._get_fused(f"{layer}.self_attn.qkv_proj.weight")  # (H*D + 2*G*D, d): [q | k | v]
            q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            q, k, v = fused.split([q_rows, kv_rows, kv_rows])
            return {"q_proj": q, "k_proj": k, "v_proj": v}[part.split(".")[0]].clone()
        layer, sep, part = name.partition(".mlp.")
        if sep and part in ("gate_proj.weight", "up_proj.weight"):
            gate, up = self._get_fused(f"{layer}.mlp.gate_up_proj.weight").chunk(2)  # (2*I, d): [gate | up]
            return (gate if part == "gate_proj.weight" else up).clone()
        return None

    def _gemma(self, name: str) -> torch.Tensor | None:
        if name == EMBED:  # GemmaTextScaledWordEmbedding multiplies by sqrt(hidden) (exact in fp32)
            return self._get(EMBED) * self.config.hidden_size**0.5
        if name == FINAL_NORM or name.endswith("layernorm.weight"):  # GemmaRMSNorm: x_hat * (1 + w)
            return 1.0 + self._get(name)
        return None
