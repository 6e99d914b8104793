"""Conversion methods: every quality-relevant choice as a named switch, and the presets built from them.

`transmla` re-implements the published TransMLA recipe from its description (key-energy PCA per
frequency, freqfold, K/V norm balancing, plain joint PCA); `default` is ours. Each field can be
overridden on the command line (`--set name=value`) so ablations need no code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from .errors import UserError
from .ops.basis import LATENT_BASES, ROPE_KEY_BALANCES
from .ops.kv_quant import SIMULATED_CACHE_TYPES


@dataclass(frozen=True)
class Method:
    # Which component of each rotary slot keeps RoPE: "key" = most key energy (TransMLA);
    # "score" = most query-weighted score energy, weighted by how much RoPE moves it.
    rope_weighting: str = "key"
    # Rotary slots pooled per PCA (TransMLA's freqfold); 1 = one slot per pool.
    rope_pool: int = 1
    # What replaces RoPE on the RoPE-free components: "none" (identity) or "expected" (the mean
    # rotation over the calibration attention distances, folded into the query).
    nope_rotation: str = "none"
    # Joint latent PCA weighting: "plain" (activation energy) or "attention" (keys by the queries
    # that read them, values by o_proj).
    latent_weighting: str = "attention"
    # Key/value balance in the joint PCA: "norm" (equal energy) or "output" (score errors in output units).
    kv_balance: str = "norm"
    # Layer-local refinement towards the source attention output (0 = closed form only): Adam steps,
    # learning rate relative to each tensor's RMS, windows per step, query positions per window
    # (0 = all), and how many calibration windows it may use.
    # Default 600 steps on up to 128 windows: on SmolLM2 at 192/384 more steps and more windows each
    # improved every domain, in-domain included (README: cross-domain quality).
    refine_steps: int = 600
    refine_lr: float = 4e-3
    refine_batch: int = 4
    refine_queries: int = 128
    refine_windows: int = 128
    # Rounds of the closed-form value-path fit after the Adam steps (0 = none): o_proj and kv_b's value rows
    # refitted by least squares for the attention the fit ended with (ops/value_solve.py). Off: it lowers the
    # in-domain loss but fits the calibration text's value statistics; on SmolLM2 at 192/384 calibrated on news
    # (200 steps) it took news -> docs from 1.518 to 1.628 (docs/crossdomain-rows-cpu-2026-11-25.jsonl).
    refine_value_solve: int = 0
    # Pull of the refinement toward its closed-form start (0 = none): anchor x mean relative squared change
    # of the weights, added to the fitted loss (a prior against over-fitting the calibration text).
    refine_anchor: float = 0.0
    # Input noise of the refinement (0 = none): each training window is perturbed by Gaussian noise of up
    # to this fraction of each channel's RMS and fitted to the source block's output on it, so the fit
    # also holds off the calibration text's own directions.
    refine_noise: float = 0.0
    # Share of the calibration windows whose second half repeats their first half (0 = none; data.with_repeats).
    # A repeat is where a model copies: the token after the earlier occurrence predicts the next one, a sharp
    # attention to one far key that a low-rank key loses first (SmolLM2 at 160 + 32, 200 steps: next-token accuracy
    # on a repeated random span 0.672 -> 0.346). Natural calibration text rarely repeats, so neither the statistics
    # nor the refinement weigh it; this puts copying into both. Measured at 0.25 (160 + 32, 200 steps): copying at
    # span 64 0.282 -> 0.353 and at span 512 0.014 -> 0.041 (the original 0.626 / 0.428), LAMBADA 0.252 -> 0.256
    # (within noise), docs perplexity unchanged (1.135x): too little to be a default (docs/benchmarks.md, "Copying").
    calib_repeat: float = 0.0
    # Basis of the latent (exact: any orthogonal rotation folds into kv_a and kv_b; ops/basis.py): "pca" (the
    # closed form's order, energy piled into the first channels), "hadamard" (randomized Hadamard: every
    # 32-value block of a quantized cache gets loud and quiet channels alike), "random" (a seeded rotation).
    # Both bases are applied after the refinement (before it when refine_cache fits through a quantized cache), so
    # they change only how the cache quantizes, never what the model computes: on by default.
    latent_basis: str = "hadamard"
    # Rotary-key pairs scaled by energy^-p, queries inversely (exact; ops/basis.py): "none", "energy" (p = 1/2,
    # equal energy) or "partial" (p = 0.3). The rotary key is what a 4-bit cache hurts most; on SmolLM2 160 + 32
    # (torch simulation, docs) "partial" cut a q4_0 cache's cost from 1.36x to 1.20x, "energy" to 1.28x.
    rope_key_balance: str = "partial"
    # Cache type the layer-local refinement fits through (quantization-aware, straight-through gradient):
    # "none" (exact cache), or a llama.cpp type (f16, q8_0, q5_0, q5_1, q4_0, q4_1; ops/kv_quant.py).
    refine_cache: str = "none"
    # Inputs each layer is calibrated on: "source" (source model's hidden states) or "converted"
    # (the converted model's own hidden states, so errors do not accumulate across layers).
    calib_inputs: str = "source"
    # Sources that normalize each head's query (Qwen3's per-head q RMSNorm, not linear): "keep" writes the query
    # as DeepSeek's q_lora path with a genuine q_a_layernorm, one RMSNorm over the whole query (q_a_proj the
    # source's q_proj, q_b_proj its per-head weights; at most hidden x hidden more query parameters per layer,
    # ops/qk_norm.compact_query); "fold" folds the norm into per-head scales of a plain q_proj. No effect on
    # sources without query norms. On small Qwen3 models trained here, "keep" cut the full-rank cost over a Llama
    # control from 1.053x to 1.047x and the half-cache cost from 1.099x to 1.057x (docs/families.md).
    query_norm: str = "keep"
    # A bias-free output of a source with attention biases (Qwen2; --target vllm/llamacpp): each bias is folded into
    # the weights through the input's near-constant direction (ops/bias_fold.py) before refinement. "joint" gives
    # the value bias to the joint latent PCA as signal (the latent carries it), "constant" folds it after the latent
    # is chosen (least squares into its value span); "none" drops every bias and leaves them to the refinement.
    # No effect when biases are kept or absent.
    bias_fold: str = "joint"
    # The first layer's input (the normalized embedding) has no near-constant direction to fold its biases through:
    # "embedding" replaces the embedding channel the vocabulary uses least by a value that the first layer's norm
    # reads as one constant on every token (ops/bias_fold.with_constant_channel), "none" leaves the embedding as it is.
    # On Qwen2.5-Coder-1.5B at 160 + 64, closed form, the first layer's biases folded cost 16.0 perplexity over 12.3
    # with them kept, 14.5 with the channel (the original itself: 5.466 -> 5.449).
    constant_channel: str = "embedding"
    # How much of the rotary key's bias is folded: "rotating" (each rotary slot in proportion to how far it turns
    # over the calibration's attention distances; the rest is a logit the softmax drops) or "all".
    rope_bias_fold: str = "rotating"

    # Shrinkage of the attention-input covariance toward a prior that trusts the calibration text less
    # (0 = none, 1 = the prior alone): "diag" keeps per-channel energy and damps correlations,
    # "identity" prefers no direction.
    # Default 1.0 (the diagonal alone): on SmolLM2 at 192/384 calibrated on news it cut the worst
    # other-domain ratio from 2.09 (none) and 1.66 (0.5) to 1.55, and with the default refinement to 1.50
    # (README: cross-domain quality).
    moment_shrinkage: float = 1.0
    shrink_target: str = "diag"

    def with_overrides(self, pairs: list[str]) -> "Method":
        changes = {}
        types = {f.name: f.type for f in fields(self)}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise UserError(f"--set {pair}: expected name=value with name in {', '.join(types)}")
            kind = type(getattr(self, key))
            try:
                changes[key] = kind(value)
            except ValueError as exc:
                raise UserError(f"--set {pair}: {value!r} is not a valid {kind.__name__}") from exc
        method = replace(self, **changes)
        method.validate()
        return method

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"method setting {f.name}={value} must be a finite number")
        choices = {
            "rope_weighting": ("key", "score"),
            "nope_rotation": ("none", "expected"),
            "latent_weighting": ("plain", "attention"),
            "kv_balance": ("norm", "output"),
            "calib_inputs": ("source", "converted"),
            "shrink_target": ("diag", "identity"),
            "latent_basis": LATENT_BASES,
            "rope_key_balance": tuple(ROPE_KEY_BALANCES),
            "refine_cache": ("none", *SIMULATED_CACHE_TYPES),
            "query_norm": ("keep", "fold"),
            "bias_fold": ("joint", "constant", "none"),
            "rope_bias_fold": ("rotating", "all"),
            "constant_channel": ("embedding", "none"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"method setting {key}={getattr(self, key)!r} must be one of {allowed}")
        if self.kv_balance == "output" and self.latent_weighting != "attention":
            raise UserError("kv_balance=output needs latent_weighting=attention")
        if self.refine_value_solve < 0:
            raise UserError(f"refine_value_solve={self.refine_value_solve} must be >= 0")
        if self.refine_cache != "none" and not self.refines:
            raise UserError(f"refine_cache={self.refine_cache} needs refinement (refine_steps or refine_value_solve > 0)")
        if self.refine_lr <= 0:
            raise UserError(f"refine_lr={self.refine_lr} must be > 0")
        if self.refine_anchor < 0:
            raise UserError(f"refine_anchor={self.refine_anchor} must be >= 0")
        if self.refine_noise < 0:
            raise UserError(f"refine_noise={self.refine_noise} must be >= 0")
        if not 0.0 <= self.calib_repeat <= 1.0:
            raise UserError(f"calib_repeat={self.calib_repeat} must be between 0 and 1")
        if not 0.0 <= self.moment_shrinkage <= 1.0:
            raise UserError(f"moment_shrinkage={self.moment_shrinkage} must be between 0 and 1")
        if min(self.refine_steps, self.refine_queries) < 0 or min(self.rope_pool, self.refine_batch,
                                                                    self.refine_windows) < 1:
            raise UserError("refine_steps/refine_queries must be >= 0; rope_pool, refine_batch and "
                            "refine_windows >= 1")

    @property
    def refines(self) -> bool:
        """Does the conversion fit each layer to the source layer's output (Adam steps or the value solve)?"""
        return bool(self.refine_steps or self.refine_value_solve)

    def as_dict(self) -> dict:
        return asdict(self)


# What a setting added later was before it existed: records (conversion.json, benchmark rows) that predate it were
# made with this value. query_norm: the records these are read for (eval/quality.py, eval/heal.py) all convert
# SmolLM2, a Llama without query norms, where "keep" and "fold" are the same conversion; Qwen3 conversions made
# before it folded the query norm (eval/families.py labels those rows +query_norm=fold).
BEFORE_SETTING = {"latent_basis": "pca", "rope_key_balance": "none", "refine_cache": "none", "refine_value_solve": 0,
                  "query_norm": "keep", "bias_fold": "none", "rope_bias_fold": "all",
                  "constant_channel": "none", "calib_repeat": 0.0}


def recorded_method(record: dict) -> dict:
    """A recorded method dict completed with the settings it predates (their values then)."""
    return {**BEFORE_SETTING, **record}


PRESETS = {
    "default": Method(),
    "transmla": Method(
        rope_weighting="key",
        rope_pool=2,
        nope_rotation="none",
        latent_weighting="plain",
        kv_balance="norm",
        refine_steps=0,
        calib_inputs="source",
        moment_shrinkage=0.0,
        latent_basis="pca",  # the published recipe's tensors as it writes them
        rope_key_balance="none",
    ),
    # our closed form alone, for ablations and quick conversions (unshrunk, as measured before shrinkage)
    "closed-form": Method(refine_steps=0, moment_shrinkage=0.0),
}


def resolve_method(name: str, overrides: list[str] | None = None) -> Method:
    if name not in PRESETS:
        raise UserError(f"unknown method '{name}'; choose one of {', '.join(PRESETS)}")
    method = PRESETS[name]
    return method.with_overrides(overrides or []) if overrides else method
