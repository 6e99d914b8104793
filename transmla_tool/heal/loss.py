"""heal's loss, and the same loss at length without the vocabulary-sized logits of a whole window.

At 8192 tokens SmolLM2's logits are 8192 x 49,152 fp32 values, 1.6 GB for the student and as much for the teacher,
plus their softmaxes and the student's gradient: more than the rest of a 135M model's step. `FinalHidden` runs the
model's own forward with `logits_to_keep=1` (its output layer reads one position) and takes the last hidden state
from the decoder's output; `chunked_distill_loss` then applies each model's output layer to `chunk` positions at a
time, under activation checkpointing, so only one chunk's logits ever exist (the backward recomputes them). Every
step compares the one position the model's forward returned with the output layer applied here, so a family whose
output is not `lm_head(last hidden state)` (a softcap, a scale this code does not know) stops with an error instead
of training on wrong logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def distill_loss(student_logits, teacher_logits, labels, settings):
    """(total, kd, lm) per token; logits (B, L, V), labels (B, L) next-token targets already shifted."""
    total, kd, lm = _loss_sums(student_logits, teacher_logits, labels, settings)
    count = labels.numel()
    return total / count, kd.detach() / count, lm.detach() / count


def _loss_sums(student_logits, teacher_logits, labels, settings):
    """(total, kd, lm) summed over the tokens."""
    vocab = student_logits.shape[-1]
    s = student_logits.float().reshape(-1, vocab)
    kd = lm = torch.zeros((), device=s.device)
    if settings.kd_weight > 0 and teacher_logits is not None:
        t = settings.temperature
        log_p_student = F.log_softmax(s / t, dim=-1)
        log_p_teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / t, dim=-1)
        kd = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="sum") * t * t
    if settings.lm_weight > 0:
        lm = F.cross_entropy(s, labels.reshape(-1), reduction="sum")
    return settings.kd_weight * kd + settings.lm_weight * lm, kd, lm


def output_layer(model):
    """The function from a model's last hidden state to its logits: its output embeddings, and Granite's logit
    scaling (the families convert reads; FinalHidden checks the result against the model's own every step)."""
    module = getattr(model, "module", model)  # a DDP wrapper's model
    head = module.get_output_embeddings()
    scale = getattr(module.config, "logits_scaling", None)
    if scale is None or scale == 1:
        return head
    return lambda hidden: head(hidden) / scale


class FinalHidden:
    """model(inputs) -> its last hidden state (B, L, d), with logits computed at the last position only.

    The hidden state is read by a forward hook on the decoder (its `last_hidden_state`, after the final norm), so the
    model's forward runs as a wrapper (DDP, accelerate) calls it. `checks` counts the steps whose last-position
    logits matched the output layer applied here (the proof the chunked path ran on the right numbers)."""

    def __init__(self, model):
        self.model = model
        self.head = output_layer(model)
        self.decoder = getattr(model, "module", model).get_decoder()
        self.checks = 0
        self._captured = None

    def _capture(self, module, args, output):
        self._captured = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        self._captured = None
        hook = self.decoder.register_forward_hook(self._capture)
        try:
            logits = self.model(inputs, logits_to_keep=1).logits  # (B, 1, V)
        finally:
            hook.remove()
        hidden, self._captured = self._captured, None
        if hidden is None or hidden.shape[:2] != inputs.shape:
            raise RuntimeError("the decoder's forward hook saw no last hidden state of the window; heal with "
                               "--loss-chunk 0")
        with torch.no_grad():  # bf16 autocast inside the forward, fp32 here: a 2% tolerance, far below a missing scale
            mine, theirs = self.head(hidden[:, -1:]).float(), logits.float()
            if not torch.allclose(mine, theirs, rtol=0, atol=2e-2 * float(theirs.abs().max()) + 1e-5):
                raise RuntimeError("the output layer applied to the last hidden state does not give the model's own "
                                   "logits (a softcap or scale this version does not know); heal with --loss-chunk 0")
        self.checks += 1
        return hidden


def chunked_distill_loss(student_hidden, student_head, teacher_hidden, teacher_head, labels, settings, chunk: int):
    """distill_loss over `chunk` positions at a time from the last hidden states (B, L, d) and each model's output
    layer; the same value, with one chunk's logits alive at a time (recomputed in the backward)."""

    def sums(hidden, target_hidden, chunk_labels):
        teacher_logits = None
        if target_hidden is not None:
            with torch.no_grad():
                teacher_logits = teacher_head(target_hidden)
        return torch.stack(_loss_sums(student_head(hidden), teacher_logits, chunk_labels, settings))

    totals = torch.zeros(3, device=student_hidden.device)
    for start in range(0, labels.shape[1], chunk):
        part = slice(start, start + chunk)
        target = None if teacher_hidden is None else teacher_hidden[:, part]
        totals = totals + checkpoint(sums, student_hidden[:, part], target, labels[:, part], use_reentrant=False)
    totals = totals / labels.numel()
    return totals[0], totals[1].detach(), totals[2].detach()


@torch.no_grad()
def position_logits(model, ids: torch.Tensor, chunk: int, reader: FinalHidden | None = None):
    """Yield (start, logits) over windows ids (B, L): fp32 logits (B, n, V) of positions start .. start + n - 1, which
    predict tokens start + 1 .. start + n. From the model's logits at once when `chunk` is 0 or the window is not
    longer, else from the last hidden state (`reader`, or a new FinalHidden) `chunk` positions at a time."""
    if not chunk or ids.shape[1] <= chunk:
        yield 0, model(ids).logits[:, :-1].float()
        return
    reader = reader or FinalHidden(model)
    hidden = reader(ids)[:, :-1]
    for start in range(0, hidden.shape[1], chunk):
        yield start, reader.head(hidden[:, start:start + chunk]).float()


def position_nll(model, ids: torch.Tensor, chunk: int, reader: FinalHidden | None = None) -> torch.Tensor:
    """(B, L-1) next-token losses of windows ids (B, L), column j predicting token j+1 (position_logits's chunks)."""
    return torch.cat([F.cross_entropy(logits.transpose(1, 2), ids[:, 1 + start:1 + start + logits.shape[1]],
                                      reduction="none") for start, logits in position_logits(model, ids, chunk, reader)],
                     dim=1)


def window_nll(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed next-token negative log-likelihood of windows ids (B, L), fp64; logits `chunk` positions at a time
    (0: all at once)."""
    return position_nll(model, ids, chunk).double().sum()
