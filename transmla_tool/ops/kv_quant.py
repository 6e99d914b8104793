"""KV-cache storage types as the engines store them: bytes per value, and quantize-dequantize in torch.

The block types reproduce llama.cpp's reference quantizers (ggml/src/ggml-quants.c, quantize_row_*_ref,
which its CPU backend uses when it writes K/V into a quantized cache): blocks of 32 consecutive values
of one cached row, one fp16 scale (and for the _1 types an fp16 minimum) per block. Use them to see what
a cache type does to a layer before running the engine (the layer-local refinement fits through them,
with a straight-through gradient), and to count bytes.

Facts (llama.cpp, the llama-cpp-python 0.3.36 sdist):
- q8_0: d = amax / 127, q = round(x / d); q4_0: d = max / -8 where max is the signed value of largest
  magnitude, q = min(15, trunc(x / d + 8.5)), value (q - 8) d; q5_0 the same with 16 / 31; q4_1 / q5_1:
  d = (max - min) / 15 (31), q = trunc((x - min) / d + 0.5), value q d + min. d and min are stored as
  fp16 (the values are rebuilt from the rounded d; the codes were chosen with the unrounded one).
- iq4_nl: a non-uniform grid of 16 levels (IQ4NL_LEVELS) times one fp16 scale per block. The cache path
  (quantize_row_iq4_nl_ref, no scale search there): d = max / -127, codes = the nearest level to x / d
  (ties to the upper one), then d refitted by least squares weighted by x^2: d = sum(x^3 q) / sum(x^2 q^2),
  the codes kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class CacheType:
    name: str
    bytes_per_block: int  # per BLOCK values (for the float types: BLOCK * element size)
    kind: str  # "float", "absmax" (signed scale), "minmax" (scale and minimum), "grid" (levels times a scale)
    levels: int = 0  # codes per value for the integer types

    @property
    def bytes_per_value(self) -> float:
        return self.bytes_per_block / BLOCK


CACHE_TYPES = {t.name: t for t in (
    CacheType("f32", 4 * BLOCK, "float"),
    CacheType("f16", 2 * BLOCK, "float"),
    CacheType("bf16", 2 * BLOCK, "float"),
    CacheType("q8_0", 2 + BLOCK, "absmax", 256),
    CacheType("q5_1", 4 + 4 + BLOCK // 2, "minmax", 32),
    CacheType("q5_0", 2 + 4 + BLOCK // 2, "absmax", 32),
    CacheType("q4_1", 4 + BLOCK // 2, "minmax", 16),
    CacheType("q4_0", 2 + BLOCK // 2, "absmax", 16),
    CacheType("iq4_nl", 2 + BLOCK // 2, "grid", 16),
)}
# the types quantize_dequantize reproduces (a quantization-aware fit can target them)
SIMULATED_CACHE_TYPES = tuple(n for n in CACHE_TYPES if n != "f32")
IQ4NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def cache_type(name: str) -> CacheType:
    if name not in CACHE_TYPES:
        raise ValueError(f"unknown cache type '{name}'; choose one of {', '.join(CACHE_TYPES)}")
    return CACHE_TYPES[name]


def fits_blocks(name: str, values: int) -> bool:
    """Whether a cache row of `values` numbers can be stored as type `name`: a block type (every type but the float
    ones) stores whole blocks of BLOCK values, and llama.cpp refuses other row sizes."""
    return cache_type(name).kind == "float" or values % BLOCK == 0


def mla_cache_problem(name: str, latent: int, rope: int) -> str | None:
    """Why llama.cpp would not allocate cache type `name` for a converted model with this latent and rotary key,
    or None. Its deepseek2 caches each token's row [latent | rotary key] (n_embd_head_k) and reads the values from
    the latent part (n_embd_head_v); a block type must divide both, so the latent and the rotary key must each be
    a multiple of BLOCK (measured: 176 + 16 is refused with 'V cache type iq4_nl with block size 32 does not
    divide n_embd_head_v=176')."""
    if fits_blocks(name, latent) and fits_blocks(name, latent + rope):
        return None
    return (f"llama.cpp stores cache type {name} in {BLOCK}-value blocks and refuses a converted model whose latent "
            f"({latent}) or rotary key ({rope}) is not a multiple of {BLOCK}")


def bytes_per_token_per_layer(values_k: int, values_v: int, k_type: str, v_type: str | None = None) -> float:
    """Cache bytes for one token in one layer holding `values_k` key and `values_v` value numbers."""
    return values_k * cache_type(k_type).bytes_per_value + values_v * cache_type(v_type or k_type).bytes_per_value


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


@torch.no_grad()
def quantize_dequantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """x (..., n) stored as cache type `name` and read back (n a multiple of 32 for the block types)."""
    kind = cache_type(name)
    if kind.kind == "float":
        return x if name == "f32" else x.to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[name])).to(x.dtype)
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"a {name} cache row needs a multiple of {BLOCK} values, got {n}")
    work = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)  # (..., blocks, 32)
    if kind.kind == "absmax":
        if name == "q8_0":
            d = work.abs().amax(-1, keepdim=True) / 127
            inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            codes = torch.round(work * inv)
            out = codes * _fp16(d)
        else:
            half = kind.levels // 2  # 8 (q4_0) or 16 (q5_0)
            idx = work.abs().argmax(-1, keepdim=True)
            signed_max = work.gather(-1, idx)
            d = signed_max / -half
            inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            codes = torch.clamp(torch.trunc(work * inv + half + 0.5), max=kind.levels - 1)
            out = (codes - half) * _fp16(d)
    elif kind.kind == "grid":
        out = _iq4_nl(work)
    else:
        low, high = work.amin(-1, keepdim=True), work.amax(-1, keepdim=True)
        d = (high - low) / (kind.levels - 1)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.clamp(torch.trunc((work - low) * inv + 0.5), max=kind.levels - 1)
        out = codes * _fp16(d) + _fp16(low)
    return out.reshape(x.shape).to(x.dtype)


def _iq4_nl(work: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(IQ4NL_LEVELS, dtype=work.dtype, device=work.device)
    signed_max = work.gather(-1, work.abs().argmax(-1, keepdim=True))
    d = signed_max / levels[0]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    # nearest level, ties to the upper one: the number of midpoints at or below x / d
    q = levels[torch.bucketize(work * inv, (levels[1:] + levels[:-1]) / 2, right=True)]
    weighted = work * work * q  # ggml's weight x^2 times the level
    terms_qx, terms_q2 = weighted * work, weighted * q
    # ggml sums the 32 terms in order in float32; so do we, so that d rounds to the same fp16
    sum_qx, sum_q2 = torch.zeros_like(d), torch.zeros_like(d)
    for j in range(BLOCK):
        sum_qx, sum_q2 = sum_qx + terms_qx[..., j : j + 1], sum_q2 + terms_q2[..., j : j + 1]
    fitted = sum_qx / torch.where(sum_q2 > 0, sum_q2, torch.ones_like(sum_q2))
    d = torch.where((sum_q2 > 0) & (signed_max.abs() >= 1e-15), fitted, torch.zeros_like(d))  # ggml's GROUP_MAX_EPS
    return q * _fp16(d)


def straight_through(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> stored-and-read-back x whose gradient is the identity (quantization-aware fitting); None for
    None, f32, or a type this module does not reproduce."""
    if name is None or name == "f32":
        return None
    cache_type(name)

    def apply(x: torch.Tensor) -> torch.Tensor:
        return x + (quantize_dequantize(x.detach(), name) - x.detach())

    return apply


def cache_row_store(name: str | None, latent_dim: int, stored_latent_dim: int | None = None):
    """The store-and-read-back of a cached MLA row [latent | rotary key] (..., r + dr) as an engine holds it:
    the latent zero-padded to `stored_latent_dim` first (an output written with --pad-latent-to), so the
    32-value blocks fall where the engine's do. None when nothing is lost (no type, or f32)."""
    quant = straight_through(name)
    if quant is None:
        return None
    extra = (stored_latent_dim or latent_dim) - latent_dim
    if extra < 0:
        raise ValueError(f"stored latent {stored_latent_dim} is smaller than the latent {latent_dim}")

    def store(row: torch.Tensor) -> torch.Tensor:
        if not extra:
            return quant(row)
        padded = torch.cat([row[..., :latent_dim], row.new_zeros(*row.shape[:-1], extra), row[..., latent_dim:]], -1)
        back = quant(padded)
        return torch.cat([back[..., :latent_dim], back[..., latent_dim + extra:]], -1)

    return store


# the type llama.cpp's CPU attention converts the query to before its dot products with a cached key of each type
# (ggml-cpu's type traits: vec_dot_type; q8_1 quantizes values as q8_0 does and adds their sum). f16 keys are
# read by the tiled f32 path in prefill, so their query is not rounded.
QUERY_DOT_TYPES = {"q8_0": "q8_0", "q5_0": "q8_0", "q5_1": "q8_0", "q4_0": "q8_0", "q4_1": "q8_0", "iq4_nl": "q8_0"}


def query_dot_store(name: str | None):
    """The engine's rounding of an absorbed query row before it meets a cached row of type `name` (llama.cpp's CPU
    flash attention converts Q to the key type's dot-product type, q8_0 for every block type): x -> rounded x with
    the identity gradient, or None where the query is read as it is."""
    if name is None or name not in QUERY_DOT_TYPES:
        return None
    return straight_through(QUERY_DOT_TYPES[name])
