"""Bad input: one line on stderr naming the problem and the fix, exit status 2, nothing written."""

from __future__ import annotations

import pytest
import torch

from transmla_tool.cli import main


def _run(capsys, args):
    capsys.readouterr()  # drop what fixtures printed (save_pretrained progress bars)
    code = main(["convert", *args])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def base_args(make_model, text_file, tmp_path):
    src = make_model("llama", kv_heads=2)

    def args(**overrides):
        values = {"--model": str(src), "--latent-dim": "12", "--rope-dim": "8", "--output": str(tmp_path / "out"),
                  "--calib-data": str(text_file), "--calib-samples": "4", "--calib-seq-len": "32",
                  "--device": "cpu", "--target": "auto"}
        values.update(overrides)
        flat = [x for k, v in values.items() if v is not None for x in (k, v)]
        return flat + ["--no-progress"]

    return args


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"--latent-dim": "0"}, "--latent-dim must be positive"),
        ({"--latent-dim": "57"}, "exceeds the rank a layer can have (56"),
        ({"--rope-dim": "7"}, "positive even number"),
        ({"--rope-dim": "32"}, "larger than the source head_dim 16"),
        ({"--rope-dim": "6"}, "must divide head_dim 16"),
        ({"--dtype": "float16"}, "float16 cannot represent the linearized latent RMSNorm"),
        ({"--calib-data": "/nonexistent/text.txt"}, "does not exist"),
        ({"--model": "/nonexistent/model"}, "neither a local directory nor a valid hub id"),
        ({"--device": "tpu"}, "--device must be"),
        ({"--method": "magic"}, "unknown method 'magic'"),
        ({"--target": "vllm"}, "--target vllm: latent 12 + rope 8 = 20: vLLM 0.32.0 (CPU build) serves MLA only at "
                               "320/512/576"),
        ({"--pad-latent-to": "8"}, "--pad-latent-to 8 is smaller than --latent-dim 12"),
        ({"--max-shard-size": "abc"}, "--max-shard-size 'abc'"),
        ({"--set": "refine_cache=q4_0"}, "refine_cache=q4_0: llama.cpp stores cache type q4_0 in 32-value blocks and "
                                         "refuses a converted model whose latent (12) or rotary key (8)"),
    ],
)
def test_bad_arguments(capsys, base_args, tmp_path, overrides, needle):
    nested = tmp_path / "new" / "deeper" / "out"
    code, err = _run(capsys, base_args(**{"--output": str(nested), **overrides}))
    assert code == 2
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "new").exists()  # a refused convert creates no directory, parents included


def test_existing_output_needs_overwrite(capsys, base_args, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    code, err = _run(capsys, base_args())
    assert code == 2 and "already exists; pass --overwrite" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "user data"
    # --overwrite replaces only what this tool wrote: a user's directory stays
    code, err = _run(capsys, [*base_args(), "--overwrite"])
    assert code == 2 and "was not written by transmla-tool" in err and len(err.splitlines()) == 1
    assert (tmp_path / "out" / "keep.txt").read_text() == "user data"
    ours = tmp_path / "ours"
    assert main(["convert", *base_args(**{"--output": str(ours)})]) == 0
    (ours / "stale.txt").write_text("from the first run")
    assert main(["convert", *base_args(**{"--output": str(ours)}), "--overwrite"]) == 0
    assert (ours / "model.safetensors").exists() and not (ours / "stale.txt").exists()


def test_unsupported_family(capsys, base_args, tmp_path, tokenizer_dir):
    """Gemma 2 normalizes sublayer outputs: refused with that reason, nothing written."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    path = tmp_path / "gemma2"
    Gemma2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    code, err = _run(capsys, base_args(**{"--model": str(path)}))
    assert code == 2 and "model_type 'gemma2' is unsupported because" in err and "post-" in err
    assert not (tmp_path / "out").exists()


def test_phi3_longrope_refused(capsys, base_args, tmp_path, tokenizer_dir):
    """Phi-3's LongRoPE (the 128K models) has no DeepSeek-V3 rotary form: refused, naming the rope type."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    half = 8  # head_dim 16: LongRoPE has one factor per rotary pair
    config = Phi3Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=None, max_position_embeddings=512,
                        original_max_position_embeddings=128,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * half,
                                      "long_factor": [2.0] * half})
    path = tmp_path / "phi3"
    Phi3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    code, err = _run(capsys, base_args(**{"--model": str(path)}))
    assert code == 2 and "rope_type 'longrope' is unsupported" in err


def test_sliding_window_refused_unless_asked(capsys, base_args, tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=256)
    path = tmp_path / "mistral"
    MistralForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    code, err = _run(capsys, base_args(**{"--model": str(path)}))
    assert code == 2 and "sliding_window=16" in err and "--ignore-sliding-window" in err
    assert main(["convert", *base_args(**{"--model": str(path)}), "--ignore-sliding-window"]) == 0


def test_missing_tensor(capsys, base_args, make_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = make_model("llama", kv_heads=2)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    code, err = _run(capsys, base_args(**{"--model": str(broken)}))
    assert code == 2 and "model.layers.1.self_attn.k_proj.weight' is missing" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def _interrupt_at(monkeypatch, part_name):
    """Raise KeyboardInterrupt when the writer is about to write part `part_name`."""
    from transmla_tool.io import writer

    original = writer.ShardedWriter.add_part

    def flaky(self, part, tensors):
        if part == part_name:
            raise KeyboardInterrupt
        return original(self, part, tensors)

    monkeypatch.setattr(writer.ShardedWriter, "add_part", flaky)


def test_interrupt_before_any_layer_leaves_nothing(base_args, tmp_path, monkeypatch):
    """Ctrl-C before a layer is finished: no output directory, no staging directory."""
    _interrupt_at(monkeypatch, "layer-00000")
    assert main(["convert", *base_args()]) == 130
    assert not list(tmp_path.glob("*out*")) and not list(tmp_path.glob(".out*"))


def test_resume_after_interrupt_is_bit_identical(base_args, tmp_path, monkeypatch, capsys):
    """Ctrl-C after layer 0 (of 2): no output directory, a hidden resumable one; `--resume` finishes it and
    the checkpoint equals an uninterrupted conversion's byte for byte. Without --resume or --overwrite a
    rerun refuses to touch the unfinished work."""
    import hashlib

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    reference = tmp_path / "reference"
    assert main(["convert", *base_args(**{"--output": str(reference)})]) == 0

    with monkeypatch.context() as patch:
        _interrupt_at(patch, "layer-00001")
        assert main(["convert", *base_args()]) == 130
    assert "--resume" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert (tmp_path / ".out.partial" / "RESUMABLE").exists()

    code, err = _run(capsys, base_args())
    assert code == 2 and "with --resume to continue it" in err

    code, err = _run(capsys, [*base_args(**{"--latent-dim": "16"}), "--resume"])
    assert code == 2 and "was made with other settings (--latent-dim: 12 -> 16" in err
    assert (tmp_path / ".out.partial").exists()  # a refused resume keeps the unfinished work

    assert main(["convert", *base_args(), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert digest(tmp_path / "out") == digest(reference)
    assert not list(tmp_path.glob(".out*"))
    assert not (tmp_path / "out" / "parts").exists() and not (tmp_path / "out" / "resume").exists()


def test_too_little_calibration_text(capsys, base_args, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    code, err = _run(capsys, base_args(**{"--calib-data": str(short)}))
    assert code == 2 and "fewer than the 1 needed" in err


def test_unknown_override(capsys, base_args):
    code, err = _run(capsys, [*base_args(), "--set", "bogus=1"])
    assert code == 2 and "--set bogus=1" in err


@pytest.mark.parametrize("value", ["rope_weighting=energy", "refine_steps=-1", "refine_noise=-0.5", "calib_repeat=1.5"])
def test_bad_override_values(capsys, base_args, value):
    code, err = _run(capsys, [*base_args(), "--set", value])
    assert code == 2 and len(err.splitlines()) == 1


def test_no_torch_state_leak(base_args, capsys):
    """A conversion (bf16 output, refinement on) and a refused one leave torch's global state as they found it."""
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
    code, _ = _run(capsys, [*base_args(**{"--dtype": "bfloat16"}), "--set", "refine_steps=3"])
    assert code == 0
    code, _ = _run(capsys, base_args(**{"--latent-dim": "0"}))
    assert code == 2
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()) == before


@pytest.mark.parametrize("text,needle", [
    ("convert: [unclosed\n", "is not valid YAML at line"),
    ("- just\n- a list\n", "must be a mapping of command names to settings, not a list"),
])
def test_bad_config_file(capsys, tmp_path, text, needle):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    code = main(["convert", "--config", str(recipe), "--model", "x", "--latent-dim", "8", "--output", "y"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_demo_checks_its_flags_before_converting(capsys, tmp_path, monkeypatch):
    from transmla_tool import demo

    monkeypatch.setattr(demo, "convert", lambda *a, **k: pytest.fail("converted before checking --contexts"))
    code = main(["demo", "--output-dir", str(tmp_path / "d"), "--contexts", "1024,0", "--device", "cpu"])
    assert code == 2 and "--contexts must be positive" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_demo_prints_the_conversion_time_per_stage(capsys, tmp_path, monkeypatch):
    """The demo says where its conversion time went, as `convert` does (the conversion and evaluation are stubbed:
    what is checked is what the demo prints from the conversion summary)."""
    from transmla_tool import demo

    stages = {"refine": {"seconds": 30.0, "peak_rss_mb": 1.0}, "statistics": {"seconds": 10.0, "peak_rss_mb": 1.0}}
    monkeypatch.setattr(demo, "smollm2_gguf", lambda: ("model-dir", "model.gguf"))
    monkeypatch.setattr(demo, "convert", lambda settings: {"wall_time_s": 40.0, "peak_rss_mb": 1.0, "stages": stages})
    monkeypatch.setattr(demo, "run_eval", lambda settings: {})
    monkeypatch.setattr(demo, "markdown", lambda report: "")
    demo.run_demo(demo.DemoSettings(output_dir=str(tmp_path / "d"), device="cpu", task_examples=4))
    out = capsys.readouterr().out
    assert "time per stage: refine 30.0 s (75%), statistics 10.0 s (25%)" in out, out


def test_resume_of_a_bias_folding_conversion_is_bit_identical(make_model, base_args, tmp_path, monkeypatch, capsys):
    """A biased source converted for an engine (its biases folded, layer 0 through a constant embedding channel)
    resumed after layer 0 equals the uninterrupted conversion byte for byte: the constant channel and the later
    layers' inputs are rebuilt as they were."""
    import hashlib

    src = make_model("qwen2", kv_heads=2)
    args = {"--model": str(src), "--target": "llamacpp", "--latent-dim": "24", "--set": "refine_steps=2"}

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    reference = tmp_path / "reference"
    assert main(["convert", *base_args(**args, **{"--output": str(reference)})]) == 0
    with monkeypatch.context() as patch:
        _interrupt_at(patch, "layer-00001")
        assert main(["convert", *base_args(**args)]) == 130
    assert main(["convert", *base_args(**args), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert digest(tmp_path / "out") == digest(reference)
