"""GGUF tokenizers: transformers' tokenizer of a GGUF source with the special tokens the file names, and the
tokenizer of an exported GGUF (copied from a GGUF of the source model, or built from tokenizer.json)."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .io.gguf_fields import field_number

# The pre-tokenizer names llama.cpp's loader knows (src/llama-vocab.cpp of the llama-cpp-python 0.3.36 sdist; any
# other name makes it refuse the file). tests/test_engines.py checks this list against the built source.
LLAMA_CPP_PRE_TOKENIZERS = (
    "a.x-4.0", "afmoe", "bailingmoe", "bailingmoe2", "bloom", "chameleon", "chatglm-bpe", "codeshell", "cohere2moe",
    "command-r", "dbrx", "deepseek-coder", "deepseek-llm", "deepseek-r1-qwen", "deepseek-v3", "default", "exaone",
    "exaone-moe", "exaone4", "f2llmv2", "falcon", "falcon-h1", "falcon3", "gemma4", "gigachat", "glm4", "glm5",
    "gpt-2", "gpt-4o", "gpt3-finnish", "granite-docling", "granite-embed-multi-311m", "granite-embed-multi-97m",
    "grok-2", "hunyuan", "hunyuan-dense", "hy_v4", "jais", "jais-2", "jina-de", "jina-es", "jina-v1-en",
    "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-v5-nano", "joyai-llm", "kanana2", "kimi-k2", "kormo", "laguna",
    "lfm2", "llada-moe", "llama-bpe", "llama-v3", "llama3", "llama4", "megrez", "mellum", "mellum2", "midm-2.0",
    "minerva-7b", "minicpm5", "minimax-m2", "modern-bert", "mpt", "olmo", "phi-2", "pixtral", "poro-chat", "qwen2",
    "qwen35", "refact", "roberta-bpe", "sarvam-moe", "seed-coder", "smaug-bpe", "smollm", "solar-open", "spark2_5",
    "stablelm2", "starcoder", "superbpe", "talkie", "tekken", "tiny_aya", "trillion", "ufakzeka", "viking",
    "whitespace", "youtu",
)


# the special-token roles a GGUF names, as transformers calls them
GGUF_SPECIAL_TOKENS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                       "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(path: str | Path, reader=None) -> dict[str, int]:
    """{role: token id} for the special tokens the GGUF's metadata names (`reader`: the file already open)."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    ids = {}
    for role, key in GGUF_SPECIAL_TOKENS.items():
        field = reader.fields.get(key)
        if field is not None:
            ids[role] = field_number(field)
    return ids


def load_gguf_tokenizer(directory: str, gguf_file: str, reader=None):
    """transformers' tokenizer of a GGUF, its special tokens set to the ones the file names. transformers before 5.24
    (5.15 and 5.17 seen) read SmolLM2's end of text (id 2, <|im_end|>) as id 1 (<|im_start|>) and no padding
    token: documents were joined by the wrong token and saved tokenizers carried it, so the same text scored 0.6%
    apart on two transformers versions pyproject allows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    for role, token_id in gguf_special_token_ids(Path(directory) / gguf_file, reader).items():
        if 0 <= token_id < len(tokenizer) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def write_tokenizer(writer, ckpt: Path, source_gguf: str | None, pre: str | None, vocab_size: int) -> None:
    import gguf

    if source_gguf:
        try:
            reader = gguf.GGUFReader(source_gguf)
        except (ValueError, OSError, KeyError) as exc:
            raise UserError(f"--tokenizer-gguf {source_gguf} is not a readable GGUF file ({exc})") from exc
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        count = len(tokens.data) if tokens is not None else 0
        if tokens is not None and count != vocab_size:
            raise UserError(f"--tokenizer-gguf {source_gguf} has {count} tokens but the checkpoint's vocab_size is "
                            f"{vocab_size}: pass a GGUF of the model this checkpoint was converted from")
        copied = 0
        for key, field in reader.fields.items():
            if not key.startswith("tokenizer."):
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
            copied += 1
        if not copied:
            raise UserError(f"{source_gguf} holds no tokenizer; pass another --tokenizer-gguf or --tokenizer-pre")
        return
    if not (ckpt / "tokenizer.json").exists():
        raise UserError(f"{ckpt} has no tokenizer.json; pass --tokenizer-gguf <a GGUF of the source model>")
    try:
        vocab = gguf.vocab.BpeVocab(ckpt)
    except Exception as exc:  # not a byte-level BPE tokenizer (e.g. SentencePiece)
        raise UserError(f"cannot build a llama.cpp vocabulary from {ckpt}/tokenizer.json ({exc}); pass "
                        "--tokenizer-gguf <a GGUF of the source model>") from exc
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    if len(tokens) > vocab_size:
        raise UserError(f"{ckpt}/tokenizer.json has {len(tokens)} tokens, more than the checkpoint's vocab_size "
                        f"{vocab_size}")
    # the embedding has vocab_size rows (Qwen2.5: 151,936 for ~151,665 tokens): llama.cpp wants one token per row,
    # so the rest are unused placeholders, as llama.cpp's own converter writes them
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(ckpt, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
