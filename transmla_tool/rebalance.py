"""Balance the rotary key of a checkpoint already converted (or healed) for a quantized KV cache.

The rotary key is what a 4-bit cache hurts most (ops/basis.py): its pairs' energies differ by up to ~40x, so
the loud ones set the scale of their 32-value block. `convert` scales the pairs while converting (the default
`rope_key_balance=partial`); this does the same to a finished stock checkpoint that does not carry the balance (one
converted before that default, or with `rope_key_balance=none`), so a conversion or a long healing run need not be
repeated. Each layer's attention input is measured on a little calibration text (the energies
the cache will hold), the rotary-key pairs are scaled by energy^-p and the queries inversely, and the
checkpoint is written back (atomically). The model computes the same function, to rounding; only what its
cache stores changes.

`--balance` names the balance the checkpoint should *carry*, relative to its unbalanced rotary key: a checkpoint
converted with the default (`rope_key_balance=partial`) already carries `partial`, so rebalancing it (or the model
healed from it) to `partial` changes nothing, where applying energy^-0.3 again would over-balance it. What a
checkpoint carries is read from its conversion.json and from the rebalance.json of an earlier rebalance; the pairs
are then scaled by energy^-q with q chosen so that energy_now^(1 - 2q) = energy_unbalanced^(1 - 2p).
Scaling is exact for any scales, and "energy" (p = 1/2) makes the pairs' energies equal whatever they carried.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .convert import DEFAULT_CALIB_DATA
from .data import token_windows
from .devices import resolve_device
from .errors import UserError
from .io.staging import check_target, local_paths
from .methods import recorded_method
from .ops.basis import ROPE_KEY_BALANCES, balance_rope_key, rope_pair_energy


@dataclass
class RebalanceSettings:
    model: str  # a stock checkpoint written by convert or heal
    output: str
    balance: str = "partial"
    calib_data: str = DEFAULT_CALIB_DATA  # convert's: web text, code and dialogue from the hub
    calib_samples: int = 16
    calib_seq_len: int = 512
    text_field: str = "text"
    batch_size: int = 4
    device: str = "auto"
    overwrite: bool = False

    def validate(self) -> None:
        if self.balance not in ROPE_KEY_BALANCES or self.balance == "none":
            raise UserError(f"--balance must be one of {', '.join(b for b in ROPE_KEY_BALANCES if b != 'none')}, "
                            f"got {self.balance!r}")
        if min(self.calib_samples, self.calib_seq_len, self.batch_size) < 1:
            raise UserError("--calib-samples, --calib-seq-len and --batch-size must be >= 1")
        if not Path(self.model).exists():
            raise UserError(f"checkpoint {self.model} does not exist; pass the directory transmla-tool convert or heal "
                            "wrote")
        if not (Path(self.model) / "conversion.json").exists():
            raise UserError(f"{self.model} has no conversion.json: rebalance reads checkpoints written by "
                            "transmla-tool convert or heal (their latent norm is linearized); convert the model first")
        relative_power(carried_power(self.model), ROPE_KEY_BALANCES[self.balance])  # refuses what cannot be reached
        check_target(self.output, self.overwrite, self.inputs())

    def inputs(self) -> list[Path]:
        return local_paths(self.model, self.calib_data)


def rebalance(settings: RebalanceSettings) -> dict:
    """Write settings.model with its rotary keys balanced to settings.output; returns what was done."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .heal.export import checkpoint_dtype
    from .heal.model import to_natural
    from .io.stock import write_stock_checkpoint

    settings.validate()
    device = resolve_device(settings.device)
    dtype = checkpoint_dtype(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32).to(device).eval()
    to_natural(model)
    calib = settings.calib_data
    windows = token_windows(calib, tokenizer, settings.calib_seq_len, settings.calib_samples,
                            text_field=settings.text_field)
    moments = attention_input_moments(model, windows.to(device), settings.batch_size)
    power = ROPE_KEY_BALANCES[settings.balance]
    carried = carried_power(settings.model)
    applied = relative_power(carried, power)
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        with torch.no_grad():
            before = attn.weights().to(torch.float64, "cpu")
        after = balance_rope_key(before, moments[i], applied)
        assign_weights(attn, after)
        layers.append({"layer": i, "pair_energy_spread_before": round(_spread(before, moments[i]), 3),
                       "pair_energy_spread_after": round(_spread(after, moments[i]), 3)})
    record = {"settings": asdict(settings), "power": power, "carried_power_before": carried,
              "applied_power": round(applied, 6), "carried_power": power, "calib_tokens": int(windows.numel()),
              "layers": layers}
    section = (f"## Rotary key balanced for a quantized cache\n\nThe rotary key now carries `{settings.balance}` "
               f"(energy^-{power} of its unbalanced pairs; it carried p = {carried} before): its pairs were scaled by "
               f"energy^-{applied:.3g}, measured on {windows.numel()} tokens of `{calib}`, and the queries inversely: "
               "the same model, whose cached rotary key quantizes better (q4_0, iq4_nl). See rebalance.json.")
    natural = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    write_stock_checkpoint(natural, model.config, output=settings.output, overwrite=settings.overwrite,
                           tokenizer=tokenizer, source_dir=settings.model, dtype=dtype,
                           records={"rebalance.json": record}, sections=[section], kind="rebalance",
                           inputs=settings.inputs())
    return record


def carried_power(model_dir) -> float:
    """The balance p (pairs scaled by energy^-p of the unbalanced key) that the checkpoint's rotary key carries:
    the last rebalance's, else its conversion's `rope_key_balance` (none for conversions that predate it)."""
    folder = Path(model_dir)
    base = ROPE_KEY_BALANCES[recorded_method(
        json.loads((folder / "conversion.json").read_text()).get("settings", {}).get("method", {}))["rope_key_balance"]]
    if not (folder / "rebalance.json").exists():
        return base
    record = json.loads((folder / "rebalance.json").read_text())
    if "carried_power" in record:
        return record["carried_power"]
    return 0.5 * (1 - (1 - 2 * base) * (1 - 2 * record["power"]))  # written before rebalance.json recorded it


def relative_power(carried: float, target: float) -> float:
    """q such that energy_now^-q takes a key carrying `carried` to one carrying `target` (energy_now =
    energy_unbalanced^(1 - 2 carried))."""
    if carried >= 0.5 and target < 0.5:
        raise UserError("this checkpoint's rotary-key pairs were balanced to equal energies (energy); the spread they "
                        "came from is gone, so it cannot carry a partial balance: rebalance the checkpoint it was made from")
    if carried >= 0.5:
        return 0.5
    return 0.5 * (1 - (1 - 2 * target) / (1 - 2 * carried))


@torch.no_grad()
def attention_input_moments(model, windows: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """Per layer, the augmented moment E[[x;1][x;1]^T] (fp64, CPU) of the attention's normalized input."""
    sums: dict[int, torch.Tensor] = {}
    tokens = 0

    def hook(index):
        def grab(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            flat = x.reshape(-1, x.shape[-1]).float()
            aug = torch.cat([flat, flat.new_ones(flat.shape[0], 1)], dim=1)
            sums[index] = sums.get(index, 0) + (aug.T @ aug).double().cpu()
        return grab

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        for rows in windows.split(batch):
            model(rows, use_cache=False)
            tokens += rows.numel()
    finally:
        for handle in handles:
            handle.remove()
    return [sums[i] / tokens for i in range(len(model.model.layers))]


def assign_weights(attn, w) -> None:
    """Copy natural weights changed by a change of basis (ops/basis.py) into a NaturalAttention: kv_a, kv_b and the
    queries (o_proj never changes)."""
    attn.kv_a_proj.weight.data.copy_(w.kv_a)
    attn.kv_b_proj.weight.data.copy_(w.kv_b)
    if attn.kv_a_proj.bias is not None:
        attn.kv_a_proj.bias.data.copy_(w.kv_a_bias)
    if attn.q_b_proj is not None:
        attn.q_b_proj.weight.data.copy_(w.q_b)
    else:
        attn.q_proj.weight.data.copy_(w.q)
        if attn.q_proj.bias is not None:
            attn.q_proj.bias.data.copy_(w.q_bias)


def _spread(w, moment) -> float:
    energy = rope_pair_energy(w, moment)
    return float(energy.max() / energy.min())

