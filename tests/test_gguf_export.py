"""export-gguf without llama.cpp: the metadata its deepseek2 loader reads, the kv_b split, the types
kept precise, and bad input refused with nothing left behind (tests/test_engines.py runs the files)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from transmla_tool.cli import main
from transmla_tool.errors import UserError
from transmla_tool.gguf_export import GGUFSettings, export_gguf
from transmla_tool.methods import PRESETS


@pytest.fixture(scope="module")
def converted(make_model, text_file, tmp_path_factory):
    from transmla_tool.convert import ConvertSettings, convert

    src = make_model("llama", kv_heads=2, head_dim=32, hidden=128, heads=4)
    out = tmp_path_factory.mktemp("gguf") / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=48, rope_dim=16, calib_data=str(text_file),
                            calib_samples=4, calib_seq_len=64, dtype="float32", device="cpu", progress=False,
                            method=PRESETS["closed-form"], target="transformers"))
    return out


def _fields(path):
    import gguf

    reader = gguf.GGUFReader(path)
    return reader, {k: f.contents() for k, f in reader.fields.items() 
                    if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}


def test_metadata_and_kv_b_split(converted, tmp_path):
    import gguf
    from safetensors.torch import load_file

    out = tmp_path / "m.gguf"
    result = export_gguf(GGUFSettings(checkpoint=str(converted), output=str(out), outtype="f16", tokenizer_pre="gpt-2"))
    reader, meta = _fields(out)
    config = json.loads((converted / "config.json").read_text())
    assert meta["general.architecture"] == "deepseek2"
    assert meta["deepseek2.attention.head_count_kv"] == 1
    assert meta["deepseek2.attention.kv_lora_rank"] == 48
    assert meta["deepseek2.attention.q_lora_rank"] == 0
    assert meta["deepseek2.attention.key_length"] == 48 + 16 and meta["deepseek2.attention.value_length"] == 48
    assert meta["deepseek2.attention.key_length_mla"] == config["qk_nope_head_dim"] + 16
    assert meta["deepseek2.leading_dense_block_count"] == config["num_hidden_layers"]
    assert "deepseek2.expert_group_count" not in meta  # llama.cpp asserts n_expert_groups < n_expert
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    tensors = {t.name: t for t in reader.tensors}
    assert result["tensors"] == len(tensors)
    # the latent projection stays f32 in an f16 file; other matrices are f16
    assert tensors["blk.0.attn_kv_a_mqa.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    # attn_k_b (per head: latent -> nope key, transposed) and attn_v_b rebuild kv_b_proj exactly (up to f16)
    state = load_file(converted / "model.safetensors")
    kv_b = state["model.layers.0.self_attn.kv_b_proj.weight"].double()
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    k_b = torch.from_numpy(np.array(tensors["blk.0.attn_k_b.weight"].data, dtype=np.float64))  # (H, r, nope)
    v_b = torch.from_numpy(np.array(tensors["blk.0.attn_v_b.weight"].data, dtype=np.float64))  # (H, v, r)
    rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + v), -1)
    assert torch.allclose(rebuilt, kv_b, rtol=1e-2, atol=1e-3)
    assert result["run_flags"] == [] and "attn_kv_a_mqa=bf16" in result["quantize"]


def test_q8_0_keeps_the_latent_projection(converted, tmp_path):
    import gguf

    out = tmp_path / "q.gguf"
    export_gguf(GGUFSettings(checkpoint=str(converted), output=str(out), outtype="q8_0", tokenizer_pre="gpt-2"))
    tensors = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert tensors["blk.0.attn_kv_a_mqa.weight"] == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_bad_input(converted, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    with pytest.raises(UserError, match="name the tokenizer"):  # converted from safetensors: no source GGUF
        export_gguf(GGUFSettings(checkpoint=str(converted), output=str(out)))
    with pytest.raises(UserError, match="must end in .gguf"):
        export_gguf(GGUFSettings(checkpoint=str(converted), output=str(tmp_path / "x.bin"), tokenizer_pre="gpt-2"))
    with pytest.raises(UserError, match="no config.json"):
        export_gguf(GGUFSettings(checkpoint=str(tmp_path), output=str(out), tokenizer_pre="gpt-2"))
    out.write_text("keep me")
    assert main(["export-gguf", str(converted), "--output", str(out), "--tokenizer-pre", "gpt-2"]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_text() == "keep me"
    biased = tmp_path / "biased"
    biased.mkdir()
    config = json.loads((converted / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps(dict(config, attention_bias=True)))
    with pytest.raises(UserError, match="--biases drop"):
        export_gguf(GGUFSettings(checkpoint=str(biased), output=str(tmp_path / "b.gguf"), tokenizer_pre="gpt-2"))


def test_failure_leaves_no_file(converted, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in converted.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "never.gguf"
    with pytest.raises(UserError, match="missing model.safetensors"):
        export_gguf(GGUFSettings(checkpoint=str(broken), output=str(out), tokenizer_pre="gpt-2"))
    assert list(tmp_path.glob("*never.gguf*")) == []


def _copy(converted, tmp_path, name, **config_changes):
    """The converted checkpoint under another name, its config.json changed (None removes a key)."""
    other = tmp_path / name
    other.mkdir()
    for f in converted.iterdir():
        if f.is_file():
            (other / f.name).symlink_to(f)
    config = json.loads((converted / "config.json").read_text())
    config.update(config_changes)
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return other


def test_refusals_are_one_line(converted, tmp_path, capsys):
    """Each bad input is a one-line error naming the problem, before any file is written."""
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "config.json").write_text("{not json")
    not_gguf = tmp_path / "tokenizer.gguf"
    not_gguf.write_bytes(b"definitely not a GGUF file" * 10)
    cases = [
        ([str(converted), "--tokenizer-pre", "definitely-not-a-pre"], "is not a pre-tokenizer llama.cpp knows"),
        ([str(malformed), "--tokenizer-pre", "gpt-2"], "is not valid JSON"),
        ([str(_copy(converted, tmp_path, "no-layers", num_hidden_layers=None)), "--tokenizer-pre", "gpt-2"],
         "lacks num_hidden_layers"),
        ([str(converted), "--tokenizer-gguf", str(not_gguf)], "is not a readable GGUF file"),
    ]
    for args, needle in cases:
        out = tmp_path / "x.gguf"
        assert main(["export-gguf", *args, "--output", str(out)]) == 2, needle
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
        assert not list(tmp_path.glob("*x.gguf*"))


def test_token_list_fills_the_vocabulary(converted, tmp_path):
    """An embedding with more rows than the tokenizer has tokens (Qwen2.5) gets one unused placeholder per extra
    row; a tokenizer GGUF whose token count differs from vocab_size is refused."""
    import gguf

    config = json.loads((converted / "config.json").read_text())
    padded = _copy(converted, tmp_path, "padded", vocab_size=config["vocab_size"] + 16)
    out = tmp_path / "p.gguf"
    export_gguf(GGUFSettings(checkpoint=str(padded), output=str(out), tokenizer_pre="gpt-2"))
    reader = gguf.GGUFReader(out)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == config["vocab_size"] + 16 and tokens[-1] == f"[PAD{config['vocab_size'] + 15}]"
    assert reader.fields["tokenizer.ggml.token_type"].contents()[-1] == gguf.TokenType.UNUSED
    # the GGUF just written has vocab_size + 16 tokens: as the tokenizer of the unpadded checkpoint it is refused
    with pytest.raises(UserError, match=f"has {config['vocab_size'] + 16} tokens but the checkpoint's vocab_size"):
        export_gguf(GGUFSettings(checkpoint=str(converted), output=str(tmp_path / "q.gguf"), tokenizer_gguf=str(out)))
