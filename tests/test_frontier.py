"""Quality per cache byte: cache-type parsing, bytes, the frontier, the recommendation, and `sweep --max-cache-bytes`."""

from __future__ import annotations

import json

import pytest

from transmla_tool.cli import main
from transmla_tool.errors import UserError
from transmla_tool.evaluate.frontier import (Point, analytic_bytes, check_mla_types, markdown_table, pareto,
                                             parse_cache_types, points_from_sweep, recommend)


def test_parse_cache_types():
    assert parse_cache_types("f16, q8_0,q8_0/q4_0") == ["f16", "q8_0", "q8_0/q4_0"]
    for bad in ("q3_k", "q8_0/q4_0/q4_0", "", "f16,f16"):
        with pytest.raises(UserError):
            parse_cache_types(bad)
    with pytest.raises(UserError, match="view of the cached latent"):
        check_mla_types(["q8_0/q4_0"])


def test_analytic_bytes():
    assert analytic_bytes("q8_0/q4_0", kv_values=192) == 204 + 108
    assert analytic_bytes("q4_0", mla_values=192) == 108  # MLA in llama.cpp: K only


def _points():
    return [Point("original", "original", "f16", 768, 1.0), Point("original", "original", "q8_0", 408, 1.0002),
            Point("original", "original", "q4_0", 216, 1.065),
            Point("latent 128 + 64", "converted", "f16", 384, 1.20), Point("latent 128 + 64", "converted", "q8_0", 204, 1.201),
            Point("latent 128 + 64", "converted", "q4_0", 108, 1.30),
            Point("latent 320 + 64", "converted", "q4_0", 216, 1.05)]


def test_pareto_and_recommendation():
    points = _points()
    front = pareto(points)
    assert [(p.label, p.cache) for p in front] == [("latent 128 + 64", "q4_0"), ("latent 128 + 64", "q8_0"),
                                                   ("latent 320 + 64", "q4_0"), ("original", "q8_0"),
                                                   ("original", "f16")]
    best, advice = recommend(points, 408)
    assert best.cache == "q8_0" and best.kind == "original"
    assert advice.startswith("do not convert, quantize the cache") and "latent 320 + 64" in advice
    best, advice = recommend(points, 216)
    assert best.label == "latent 320 + 64" and advice.startswith("convert:") and "original with a q4_0" in advice
    best, advice = recommend(points, 110)
    assert best.label == "latent 128 + 64" and best.cache == "q4_0" and "no cache type gives the original" in advice
    best, advice = recommend(points, 50)
    assert best is None and "nothing measured fits" in advice
    # the best that fits, past the quality bound, is named and not recommended; the fewest bytes within it are
    best, advice = recommend(points, 110, max_ratio=1.2)
    assert best is None and advice.startswith("nothing measured at <= 110 bytes per token per layer is within")
    assert "the best that fits is latent 128 + 64 with a q4_0 cache (108 B/token/layer, ratio 1.300)" in advice
    assert advice.endswith("the fewest bytes within it: latent 320 + 64 with a q4_0 cache (216 B/token/layer, "
                           "ratio 1.050)")
    assert recommend(points, 110, max_ratio=1.0)[1].endswith("within it: original with a f16 cache (768 B/token/layer, "
                                                             "ratio 1.000)")
    assert recommend(points[3:], 110, max_ratio=1.0)[1].endswith("no measured point is within it")
    table = markdown_table(points, 768)
    assert len(table) == 2 + len(points)
    assert "| original | q4_0 | 4.5 | 216 | 3.56 | 1.065 |  |" in table  # beaten at 216 by the 320 latent
    assert "| latent 320 + 64 | q4_0 | 4.5 | 216 | 3.56 | 1.050 | yes |" in table


def test_sweep_max_cache_bytes_in_transformers(make_model, text_file, tmp_path):
    """--max-cache-bytes with the transformers engine: points at a 16-bit cache, the best fitting one named."""
    src = make_model("llama", kv_heads=2)
    out = tmp_path / "s"
    assert main(["sweep", "--model", str(src), "--output-dir", str(out), "--calib-data", str(text_file),
                 "--calib-samples", "8",
                 "--calib-seq-len", "64", "--rope-dim", "8", "--device", "cpu", "--dtype", "float32", "--method",
                 "closed-form", "--no-progress", "--latent-dims", "16,40", "--data", str(text_file), "--seq-len", "64",
                 "--max-tokens", "640", "--target", "transformers", "--max-cache-bytes", "100"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    rec = result["recommendation"]
    # 2 KV heads x 16 x 2 (K and V) = 64 values = 128 bytes at 16 bits: only the latents (24, 48 values) fit
    assert rec["point"]["kind"] == "converted"
    fits = {p["latent_dim"]: p["perplexity"] for p in result["points"] if 2 * (p["latent_dim"] + 8) <= 100}
    assert rec["point"]["latent_dim"] == min(fits, key=fits.get)
    assert "Recommendation" in (out / "sweep.md").read_text()


def test_sweep_transformers_cache_types_recommend_from_measured_bytes(make_model, text_file, tmp_path):
    """sweep --engine transformers --cache-types: every model read through transformers' caches, bytes as the caches
    held them, ratios to the original through its exact cache, and the recommendation taken from those points."""
    src = make_model("llama", kv_heads=2)
    out = tmp_path / "s"
    assert main(["sweep", "--model", str(src), "--output-dir", str(out), "--calib-data", str(text_file),
                 "--calib-samples", "8", "--calib-seq-len", "64", "--rope-dim", "8", "--device", "cpu", "--dtype",
                 "float32", "--method", "closed-form", "--no-progress", "--latent-dims", "24", "--data", str(text_file),
                 "--seq-len", "64", "--max-tokens", "192", "--target", "transformers", "--cache-types", "quanto-int4",
                 "--max-cache-bytes", "100"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert result["engine"] == "transformers" and set(result["cache_types"]) == {"original", "24+8"}
    original, latent = result["cache_types"]["original"], result["cache_types"]["24+8"]
    assert set(original) == set(latent) == {"dynamic", "quanto-int4"}
    assert original["dynamic"]["bytes"] == 2 * 2 * 16 * 4 and latent["dynamic"]["bytes"] == (24 + 8) * 4
    assert original["dynamic"]["perplexity"] == pytest.approx(result["original"]["perplexity"], rel=1e-5)
    points = points_from_sweep(result)
    assert len(points) == 4 and min(p.ratio for p in points if p.kind == "original") == 1.0
    fits = [p for p in points if p.bytes <= 100]
    best = min(fits, key=lambda p: (p.ratio, p.bytes))
    assert result["recommendation"]["point"]["cache"] == best.cache
    assert result["recommendation"]["point"]["label"] == best.label
    report = (out / "sweep.md").read_text()
    assert "Quality per cache byte in transformers" in report
    assert "| x smaller | ratio | frontier |" in report and "worst domain" not in report  # one text, no domains


@pytest.mark.parametrize("flags,needle", [
    (["--cache-types", "q4_0"], "'q4_0' is not one of transformers' caches"),
    (["--engine", "llamacpp"], "reads the original as a GGUF"),
    (["--max-cache-bytes", "0"], "--max-cache-bytes must be > 0"),
    (["--max-cache-bytes", "100", "--max-ratio", "0.9"], "--max-ratio must be >= 1"),
])
def test_sweep_engine_flags_checked_before_converting(make_model, text_file, tmp_path, capsys, flags, needle):
    src = make_model("llama", kv_heads=2)
    code = main(["sweep", "--model", str(src), "--calib-data", str(text_file), "--latent-dims", "16",
                 "--data", str(text_file), "--output-dir", str(tmp_path / "s"), "--rope-dim", "8", *flags])
    assert code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_sweep_in_llamacpp_refuses_sizes_its_cache_types_cannot_take(make_model, text_file, tmp_path, capsys,
                                                                     monkeypatch):
    """A latent or rotary key that is not a multiple of 32 under a quantized llama.cpp cache type: refused before
    the first conversion (llama.cpp would refuse it only when scoring, after every conversion), though 24 + 8 is
    one whole 32-value block per token."""
    from transmla_tool import sweep
    from transmla_tool.engines import llamacpp

    monkeypatch.setattr(llamacpp, "llama_cpp_bin", lambda name: name)  # the check comes before the engine runs
    monkeypatch.setattr(sweep, "convert_many", lambda *a, **k: pytest.fail("converted before checking"))
    src = make_model("llama", kv_heads=2)
    code = main(["sweep", "--model", str(src), "--gguf-file", "model.gguf", "--calib-data", str(text_file),
                 "--latent-dims", "24", "--data", str(text_file), "--output-dir", str(tmp_path / "s"), "--rope-dim",
                 "8", "--engine", "llamacpp", "--cache-types", "f16,q4_0"])
    err = capsys.readouterr().err
    assert code == 2 and "--cache-types q4_0 for latent 24 + rope 8: llama.cpp stores cache type q4_0" in err, err
    assert not (tmp_path / "s").exists()


def test_sweep_several_rope_dims(make_model, text_file, tmp_path):
    """`sweep --rope-dim 8,4`: every latent dim converted at each rope dim, each point the size it says it is, and the
    recommendation chosen among all of them."""
    src = make_model("llama", kv_heads=2)
    out = tmp_path / "s"
    assert main(["sweep", "--model", str(src), "--output-dir", str(out), "--calib-data", str(text_file),
                 "--calib-samples", "8", "--calib-seq-len", "64", "--rope-dim", "8,4", "--device", "cpu", "--dtype",
                 "float32", "--method", "closed-form", "--no-progress", "--latent-dims", "16,24", "--data",
                 str(text_file), "--seq-len", "64", "--max-tokens", "640", "--target", "transformers",
                 "--max-cache-bytes", "60", "--keep-checkpoints"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    pairs = {(p["latent_dim"], p["rope_dim"]): p for p in result["points"]}
    assert set(pairs) == {(16, 8), (24, 8), (16, 4), (24, 4)}
    for (latent, rope), p in pairs.items():
        assert p["values_per_token_per_layer"] == p["measured_values_per_token_per_layer"] == latent + rope
        config = json.loads((out / "checkpoints" / f"latent{latent}-rope{rope}" / "config.json").read_text())
        assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (latent, rope)
    # the same latent with a smaller rotary key is a different model: the rope dim reached the conversion
    assert pairs[(24, 4)]["perplexity"] != pairs[(24, 8)]["perplexity"]
    fits = {k: p["perplexity"] for k, p in pairs.items() if 2 * sum(k) <= 60}
    assert set(fits) == {(16, 8), (24, 4), (16, 4)}
    best = result["recommendation"]["point"]
    assert (best["latent_dim"], best["rope_dim"]) == min(fits, key=fits.get)
    assert "| 24 + 4 |" in (out / "sweep.md").read_text()


@pytest.mark.parametrize("rope,needle", [("8,8", "distinct values"), ("8,6", "--rope-dim 6 must divide head_dim")])
def test_sweep_rope_dims_checked_before_converting(make_model, text_file, tmp_path, capsys, monkeypatch, rope, needle):
    """A bad second rope dim is refused before the first one converts (nothing written, nothing converted)."""
    from transmla_tool import sweep

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted before every rope dim was checked")

    monkeypatch.setattr(sweep, "convert_many", no_conversion)
    src = make_model("llama", kv_heads=2)
    code = main(["sweep", "--model", str(src), "--calib-data", str(text_file), "--latent-dims", "16",
                 "--data", str(text_file), "--output-dir", str(tmp_path / "s"), "--rope-dim", rope])
    assert code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_max_ratio_help_states_the_default_recommend_uses():
    """cli_args keeps torch out of start-up, so its --max-ratio help spells the default out: it must be MAX_RATIO."""
    import argparse

    from transmla_tool.cli import build_parser
    from transmla_tool.evaluate.frontier import MAX_RATIO

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["sweep"]
    action = next(a for a in sub._actions if "--max-ratio" in a.option_strings)
    assert action.default is None and f"(default {MAX_RATIO:g})" in action.help
