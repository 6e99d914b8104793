"""Fixtures: a tiny BPE tokenizer trained on tests/data/tiny.txt and tiny random checkpoints of every
family we convert (GQA, MHA, MQA, biases, Llama-3 rope scaling), saved as real safetensors dirs."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data" / "tiny.txt"
# families whose conversion rewrites norm weights ((1 + w), q/k norms): their fixtures get random norm weights
NORM_FOLDING_FAMILIES = ("gemma", "granite", "phi3", "qwen3")


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """~15k tokens of English: the test paragraphs repeated in seeded random orders."""
    paragraphs = [p.strip() for p in DATA.read_text().split("\n\n") if p.strip()]
    rng = random.Random(0)
    docs = []
    for _ in range(12):
        rng.shuffle(paragraphs)
        docs.extend(paragraphs)
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("\n\n".join(docs))
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(DATA)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return path


def build_config(family: str, *, vocab: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 hidden: int = 64, layers: int = 2, rope_scaling: bool = False, attention_bias: bool = False,
                 rms_norm_eps: float = 1e-6):
    from transformers import (
        GemmaConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=512, rms_norm_eps=rms_norm_eps, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        # Llama-3.1 style scaling, with an original context short enough that the tiny model's
        # frequencies fall on all three branches (kept, scaled, smoothly interpolated).
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if family == "llama":
        return LlamaConfig(**common, rope_parameters=rope, attention_bias=attention_bias)
    if family == "mistral":
        return MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**common, rope_parameters=rope, use_sliding_window=False, attention_bias=attention_bias)
    if family == "granite":  # multipliers far from 1 (Granite 3.x: 12, 1/128, 0.22, 8) and tied embeddings
        common["tie_word_embeddings"] = True
        return GraniteConfig(**common, rope_parameters=rope, attention_bias=attention_bias, embedding_multiplier=12.0,
                             attention_multiplier=1 / 128, residual_multiplier=0.22, logits_scaling=8.0)
    if family == "phi3":
        return Phi3Config(**common, rope_parameters=rope, pad_token_id=None, sliding_window=None)
    if family == "gemma":  # tied embeddings scaled by sqrt(hidden), (1 + w) norms, GeGLU
        common["tie_word_embeddings"] = True
        return GemmaConfig(**common, rope_parameters=rope, attention_bias=attention_bias,
                           hidden_act="gelu_pytorch_tanh")
    raise ValueError(family)


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_dir):
    """make_model(family, **config) -> directory of a seeded random checkpoint with a tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict = {}

    def make(family: str = "llama", seed: int = 0, **kwargs) -> Path:
        key = (family, seed, tuple(sorted(kwargs.items())))
        if key in cache:
            return cache[key]
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = build_config(family, vocab=len(tokenizer), **kwargs)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)  # real biases (Qwen2's are large), not zeros
                elif "norm" in name and family in NORM_FOLDING_FAMILIES:  # trained norms are not at their init
                    param.add_(torch.empty_like(param).uniform_(-0.3, 0.3))
        path = tmp_path_factory.mktemp(f"{family}-model")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        cache[key] = path
        return path

    return make


@pytest.fixture
def convert_tiny(text_file, tmp_path):
    """convert_tiny(model_dir, latent_dim, **settings) -> (output dir, summary, natural weights per layer)."""
    from transmla_tool.convert import ConvertSettings, convert
    from transmla_tool.methods import PRESETS

    counter = iter(range(1000))

    def run(model_dir, latent_dim, output=None, method=None, **kwargs):
        natural = {}
        settings = ConvertSettings(
            model=str(model_dir), output=str(output or tmp_path / f"out-{latent_dim}-{next(counter)}"), latent_dim=latent_dim,
            calib_data=str(text_file), calib_samples=kwargs.pop("calib_samples", 8),
            calib_seq_len=kwargs.pop("calib_seq_len", 64), dtype=kwargs.pop("dtype", "float32"),
            device="cpu", progress=False, method=method or PRESETS["default"], **kwargs,
        )
        summary = convert(settings, on_layer=lambda i, mla: natural.__setitem__(i, mla))
        return Path(settings.output), summary, natural

    return run


@pytest.fixture(scope="session")
def trained_model(make_model, text_file, tokenizer_dir, tmp_path_factory):
    """trained_model(**config) -> a tiny checkpoint trained for a few hundred steps on the test text,
    so its perplexity means something (random models sit near uniform whatever we do to them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla_tool.data import token_windows

    cache: dict = {}

    def make(family: str = "llama", steps: int = 300, **kwargs) -> Path:
        key = (family, steps, tuple(sorted(kwargs.items())))
        if key in cache:
            return cache[key]
        src = make_model(family, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        windows = token_windows(str(text_file), tokenizer, 64)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            batch = windows[torch.randint(0, windows.shape[0], (16,), generator=gen)]
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        path = tmp_path_factory.mktemp(f"{family}-trained")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        cache[key] = path
        return path

    return make


@pytest.fixture(scope="session")
def teacher_and_student(trained_model, text_file, tmp_path_factory):
    """A trained tiny GQA teacher and its closed-form conversion at a small latent (clearly damaged)."""
    from transmla_tool.convert import ConvertSettings, convert
    from transmla_tool.methods import PRESETS

    teacher = trained_model("llama", kv_heads=2)
    student = tmp_path_factory.mktemp("heal") / "student"
    convert(ConvertSettings(model=str(teacher), output=str(student), latent_dim=8, rope_dim=8,
                            calib_data=str(text_file), calib_samples=8, calib_seq_len=64, dtype="float32",
                            device="cpu", progress=False, method=PRESETS["closed-form"]))
    return teacher, student


@pytest.fixture
def teacher_and_student_copy(teacher_and_student, tmp_path):
    """The same pair, the student copied into this test's directory: a test that writes into it leaves the shared one
    alone."""
    teacher, student = teacher_and_student
    copy = tmp_path / "student"
    shutil.copytree(student, copy)
    return teacher, copy
