"""lm-eval's loglikelihood requests answered by llama.cpp, under any of its KV-cache types.

Why the library and not llama-server: a benchmark's every row is a log-probability of a continuation given a
context, which needs the logits at every position of the prompt; llama.cpp's Python bindings (llama-cpp-python,
built by `make engines` from the same sdist as the command-line tools, so the same llama.cpp) give them directly,
in-process, with the same cache-type and flash-attention settings as `llama-perplexity -ctk/-ctv -fa on`. Tokens
come from the model's Hugging Face tokenizer (the one transformers scores with), so both engines read the same ids.

Contexts are evaluated once and reused: requests are ordered so that those sharing a prefix (a question's answer
choices, a subject's five MMLU examples) follow one another, and only the tokens after the common prefix are decoded
again; logits are asked of llama.cpp only at the positions that predict the continuation (its output layer and the
copy of the vocabulary-sized rows are skipped elsewhere).
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..errors import UserError
from .llamacpp import LLAMA_CPP_CACHE_TYPES, split_types

try:  # lm-eval is an optional dependency (the eval extra); this class only exists where it is installed
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover
    TemplateLM = object


BATCH = 512  # tokens per llama_decode call


def llama_cpp_batch(size: int):
    import llama_cpp

    return llama_cpp.llama_batch_init(size, 0, 1)


def ggml_type(name: str) -> int:
    import llama_cpp

    if name not in LLAMA_CPP_CACHE_TYPES:
        raise UserError(f"cache type {name!r} is not one of llama.cpp's: {', '.join(LLAMA_CPP_CACHE_TYPES)}")
    return getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")


def yarn_kwargs(run_flags: list[str]) -> dict:
    """LlamaCppLM's arguments for the run flags export-gguf asks llama.cpp's tools for (a Llama-3 mapping's YaRN ramp)."""
    flags = dict(zip(run_flags[::2], run_flags[1::2]))
    if "--yarn-beta-fast" not in flags:
        return {}
    return {"yarn_beta_fast": float(flags["--yarn-beta-fast"]), "yarn_beta_slow": float(flags["--yarn-beta-slow"])}


def bindings_version() -> str:
    """What scores a benchmark row: the bindings' version (they pin the llama.cpp source they are built from)."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def cpu_kernels() -> str:
    """The CPU features the bindings' llama.cpp was built for (its system info line), as llama-perplexity's logs
    give them for the command-line build (engines/llamacpp.cpu_kernels)."""
    import llama_cpp

    from .llamacpp import cpu_kernels as from_log

    return from_log("system_info: n_threads = 0 | " + llama_cpp.llama_print_system_info().decode())


def bindings_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


class LlamaCppLM(TemplateLM):
    """An lm-eval model over a GGUF run by llama.cpp with cache type `cache` ("f16", "q4_0", or "K/V" for a model
    with separate K and V caches; an MLA model caches its latent in the K type only)."""

    def __init__(self, model_path: str, tokenizer, cache: str = "f16", n_ctx: int = 2048,
                 yarn_beta_fast: float | None = None, yarn_beta_slow: float | None = None):
        super().__init__()
        if not bindings_installed():
            raise UserError("llama.cpp's Python bindings (llama-cpp-python) are not installed; run `make engines`")
        from llama_cpp import Llama

        k, v = split_types(cache)
        extra = {}
        if yarn_beta_fast is not None:
            extra.update(yarn_beta_fast=yarn_beta_fast, yarn_beta_slow=yarn_beta_slow)
        threads = max(1, len(os.sched_getaffinity(0)))
        self.llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=BATCH, n_ubatch=BATCH, logits_all=False,
                         flash_attn=True, type_k=ggml_type(k), type_v=ggml_type(v), n_threads=threads,
                         n_threads_batch=threads, verbose=False, **extra)
        self._batch = llama_cpp_batch(BATCH)
        self._held: list[int] = []  # the tokens llama.cpp's cache holds, positions 0..
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.cache = cache
        self.decoded_tokens = 0  # tokens llama.cpp decoded (reuse makes it far fewer than the requests hold)
        self.requested_tokens = 0  # tokens the requests hold

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from tqdm.auto import tqdm

        sequences = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.n_ctx + 1):]  # as lm-eval's HF backend truncates: keep the end
            sequences.append((whole, min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(sequences)), key=lambda i: sequences[i][0])
        results: list = [None] * len(sequences)
        for i in tqdm(order, desc=f"llama.cpp loglikelihood ({self.cache})", disable=disable_tqdm):
            whole, n_cont = sequences[i]
            results[i] = self._score(whole[:-1], whole[-n_cont:])
        return results

    def _score(self, inputs: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log P(continuation | the inputs before it) and whether it is the greedy continuation; `inputs` ends with
        every continuation token but the last. Only the positions that predict the continuation get logits."""
        self.requested_tokens += len(inputs)
        first = len(inputs) - len(continuation)  # position whose logits predict the first continuation token
        logits = self._decode(inputs, first)  # (C, V): position p predicts p + 1
        top = logits.max(axis=1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        picked = log_probs[np.arange(len(continuation)), continuation]
        greedy = bool((logits.argmax(axis=1) == np.asarray(continuation)).all())
        total = float(picked.sum())
        if not math.isfinite(total):
            raise RuntimeError(f"llama.cpp returned a non-finite log-probability under the {self.cache} cache")
        return total, greedy

    def _logits_after(self, tokens: list[int]) -> np.ndarray:
        return self._decode(tokens, len(tokens) - 1)[-1]

    def _decode(self, inputs: list[int], first: int) -> np.ndarray:
        """Bring llama.cpp's cache to `inputs` (keeping the longest prefix it already holds, but never the positions
        from `first` on) and return the logits at positions first..len(inputs)-1, (n, vocab) fp64."""
        import llama_cpp

        common = 0
        limit = min(len(self._held), first)  # the positions that need logits are always decoded again
        while common < limit and self._held[common] == inputs[common]:
            common += 1
        llama_cpp.llama_memory_seq_rm(self.llm._ctx.memory, 0, common, -1)
        self._held = self._held[:common]
        vocab = self.llm.n_vocab()
        rows = []
        for start in range(common, len(inputs), BATCH):
            chunk = inputs[start: start + BATCH]
            batch = self._batch
            batch.n_tokens = len(chunk)
            wanted = []
            for j, token in enumerate(chunk):
                position = start + j
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, position, 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = position >= first
                if position >= first:
                    wanted.append(j)
            if llama_cpp.llama_decode(self.llm._ctx.ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed under the {self.cache} cache")
            for j in wanted:
                rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, j),
                                                  shape=(vocab,)).astype(np.float64))
            self._held += chunk
        self.decoded_tokens += len(inputs) - common
        return np.stack(rows)

    def close(self) -> None:
        """Free llama.cpp's batch, context and model now (left to the interpreter's exit, the bindings' own clean-up
        can fail noisily)."""
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("rolling log-likelihood (perplexity tasks) is measured with llama-perplexity here; "
                                  "run `eval --engine llamacpp --cache-types ...`")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation (the long-context retrieval tasks: RULER's needles), stopping at EOS, an `until` string
        or max_gen_toks; the prompt is cut from the left to leave room for the answer."""
        from tqdm.auto import tqdm

        out = []
        for request in tqdm(requests, desc=f"llama.cpp generate ({self.cache})", disable=disable_tqdm):
            context, options = request.args
            until = [u for u in (options.get("until") or []) if u]
            budget = int(options.get("max_gen_toks", 256))
            prompt = self.tok_encode(context)[-(self.n_ctx - budget):]
            generated: list[int] = []
            token = self._greedy(prompt)
            while True:
                if token == self.eot_token_id:
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if len(generated) >= budget or any(u in text for u in until):
                    break
                token = self._greedy(prompt + generated)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out

    def _greedy(self, tokens: list[int]) -> int:
        """The most likely next token after `tokens` (the cached prefix is reused: one decode step per new token)."""
        logits = self._logits_after(tokens)
        return int(np.argmax(logits))
