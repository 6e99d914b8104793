"""`rebalance`: the rotary key of a finished checkpoint balanced after the fact (exact, atomic, recorded)."""

from __future__ import annotations

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
    converted, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, method=PRESETS["closed-form"])
    out = tmp_path / "balanced"
    assert main(["rebalance", str(converted), "--output", str(out), "--calib-data", str(text_file),
                 "--calib-samples", "4", "--calib-seq-len", "64", "--device", "cpu"]) == 0
    assert "rotary-key pairs scaled by energy^-0.3" in capsys.readouterr().out
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert rel_err(logits(out, ids), logits(converted, ids)) < 1e-5
    record = json.loads((out / "rebalance.json").read_text())
    assert record["power"] == 0.3 and len(record["layers"]) == AutoConfig.from_pretrained(src).num_hidden_layers
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
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
