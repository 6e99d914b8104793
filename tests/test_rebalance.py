"""`rebalance`: the rotary key of a finished checkpoint balanced after the fact (exact, atomic, recorded)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from helpers import logits, rel_err, sample_ids


def _rope_rows(model_dir, layer: int, rope_dim: int) -> torch.Tensor:
    state = load_file(model_dir / "model.safetensors")
    return state[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"][-rope_dim:]


def test_rebalance_keeps_the_model_and_scales_the_rotary_key(make_model, convert_tiny, text_file, tmp_path, capsys):
    from transmla_tool.cli import main
    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2)
    unbalanced = dataclasses.replace(PRESETS["closed-form"], rope_key_balance="none")  # as converted before 2026-11-26
    converted, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, method=unbalanced)
    out = tmp_path / "balanced"
    assert main(["rebalance", str(converted), "--output", str(out), "--calib-data", str(text_file),
                 "--calib-samples", "4", "--calib-seq-len", "64", "--device", "cpu"]) == 0
    assert "rotary key carries energy^-0.3 of its unbalanced pairs (scaled by energy^-0.3" in capsys.readouterr().out
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert rel_err(logits(out, ids), logits(converted, ids)) < 1e-5
    record = json.loads((out / "rebalance.json").read_text())
    assert record["power"] == record["carried_power"] == record["applied_power"] == 0.3
    assert record["carried_power_before"] == 0.0 and len(record["layers"]) == AutoConfig.from_pretrained(src).num_hidden_layers
    for layer in record["layers"]:  # p = 0.3 keeps 0.4 of the log spread
        before, after = layer["pair_energy_spread_before"], layer["pair_energy_spread_after"]
        assert before > 1.01 and after == pytest.approx(before ** 0.4, rel=0.02)
    assert (out / "conversion.json").read_text() == (converted / "conversion.json").read_text()
    assert "Rotary key balanced" in (out / "README.md").read_text()
    before, after = _rope_rows(converted, 0, 8), _rope_rows(out, 0, 8)
    assert not torch.allclose(before, after)
    # balancing again with p = 1/2 reaches equal energies whatever the scales were
    again = tmp_path / "again"
    assert main(["rebalance", str(out), "--output", str(again), "--balance", "energy", "--calib-data",
                 str(text_file), "--calib-samples", "4", "--calib-seq-len", "64", "--device", "cpu"]) == 0
    for layer in json.loads((again / "rebalance.json").read_text())["layers"]:
        assert layer["pair_energy_spread_after"] == pytest.approx(1.0, abs=1e-3)


def test_rebalance_refusals(make_model, convert_tiny, text_file, tmp_path, capsys):
    from transmla_tool.cli import main
    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2)
    assert main(["rebalance", str(src), "--output", str(tmp_path / "x"), "--calib-data", str(text_file)]) == 2
    assert "has no conversion.json" in capsys.readouterr().err
    converted, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, method=PRESETS["closed-form"])
    assert main(["rebalance", str(converted), "--output", str(converted), "--calib-data", str(text_file)]) == 2
    assert "is an input of this run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_rebalance_brings_a_checkpoint_to_the_balance_it_names(make_model, convert_tiny, text_file, tmp_path):
    """--balance is what the rotary key should carry relative to its unbalanced pairs: a default conversion already
    carries `partial` (rebalancing it to `partial` changes nothing instead of over-balancing it), a rebalance to
    `energy` evens it out, and from equal energies there is no way back to `partial` (refused, nothing written)."""
    from transmla_tool.errors import UserError
    from transmla_tool.methods import PRESETS
    from transmla_tool.rebalance import RebalanceSettings, carried_power, rebalance

    src = make_model("llama", kv_heads=2)
    converted, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, method=PRESETS["closed-form"])
    assert carried_power(converted) == 0.3  # the default's rope_key_balance

    def run(model, name, balance):
        return rebalance(RebalanceSettings(model=str(model), output=str(tmp_path / name), balance=balance,
                                           calib_data=str(text_file), calib_samples=4, calib_seq_len=64, device="cpu"))

    same = run(converted, "same", "partial")
    assert same["applied_power"] == 0.0
    assert torch.allclose(_rope_rows(tmp_path / "same", 0, 8), _rope_rows(converted, 0, 8), rtol=1e-6, atol=0)
    even = run(converted, "even", "energy")
    assert even["carried_power_before"] == 0.3 and even["applied_power"] == pytest.approx(0.5)
    assert all(layer["pair_energy_spread_after"] == pytest.approx(1.0, abs=1e-3) for layer in even["layers"])
    assert carried_power(tmp_path / "even") == 0.5
    with pytest.raises(UserError, match="balanced to equal energies"):
        run(tmp_path / "even", "back", "partial")
    assert not (tmp_path / "back").exists()
    # a rebalance.json written before it recorded carried_power: the chain of powers applied
    record = json.loads((tmp_path / "same" / "rebalance.json").read_text())
    for key in ("carried_power", "carried_power_before", "applied_power"):
        record.pop(key)
    (tmp_path / "same" / "rebalance.json").write_text(json.dumps(record))
    assert carried_power(tmp_path / "same") == pytest.approx(0.5 * (1 - 0.4 * 0.4))

