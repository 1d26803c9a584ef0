"""Key scores: each attended key's score for some rows of a step, for decode-time eviction.

H2O and TOVA (:class:`~selfattn.cache.compress.DecodeScores`) read each decode step's attention
weights over a sequence's cached keys. A caller asks for them before the forward by naming the
step's rows (:func:`want_scores`: a packed step's token rows); each layer then leaves
``plan.scores[layer] = (scores (R, Hq, L), lse (R, Hq))`` float32, ``L`` the step's
``max_pages_per_seq * P`` slots, a key's score at its slot (``scale * q . k``, -inf at slots the
row does not attend), so that the weights are ``exp(scores - lse)``.

Where the C kernel runs the step's rows (:mod:`selfattn.backends.paged.cpu`) it writes the
scores as it computes them (:func:`~selfattn.kernels.paged_decode.decode`'s ``scores``: a buffer
the size of the call's rows, no second pass), and so does the Triton kernel on a GPU
(:func:`~selfattn.kernels.triton.paged.paged_attention_triton`'s ``scores``); elsewhere
(another backend, a step with a long chunk, the modules' path, a compiled step)
:func:`record_from_pages` computes the rows' scores from their gathered keys in PyTorch. All
read the keys as the attention does: causal over the slots, no window, soft-cap or bias (the
engine offers decode-time eviction on models without them).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["record_from_pages", "score_call", "store_kernel_scores", "want_scores"]

ROWS = "rows"  # plan.scores' key of the rows asked for
EVERY_ROW = "every row"  # whether they are all the step's rows, in order


def want_scores(plan, rows: torch.Tensor) -> None:
    """Ask each layer of ``plan`` (a :class:`~selfattn.cache.paged.StepPlan`) for the key scores
    of the step's ``rows`` ``(R,)`` int64 (module docstring)."""
    plan.scores[ROWS] = rows
    n = len(rows)
    plan.scores[EVERY_ROW] = n == len(plan.seq_ids) and bool((rows == torch.arange(n)).all())


def score_call(kv, plan, call, q_rows: torch.Tensor, backend: str):
    """``call`` with a -inf score buffer ``(B, Hq, 1, L)`` for the kernel to fill where the
    step asks for scores and ``backend`` is a kernel that writes them (``"cpu"``, ``"triton"``),
    else ``call`` itself."""
    if ROWS not in plan.scores or backend not in ("cpu", "triton"):
        return call
    if torch.compiler.is_compiling():  # the kernels' custom ops take no buffer: from the pages
        return call
    L = plan.block_table.shape[1] * kv.page_size
    buf = torch.full((*q_rows.shape[:3], L), float("-inf"), device=q_rows.device)
    return dataclasses.replace(call, key_scores=buf, return_lse=True)


def store_kernel_scores(plan, layer: int, call, lse) -> bool:
    """Keep the asked rows of the kernel's buffer as ``plan.scores[layer]``; False where the
    call recorded none (the caller then records from the pages)."""
    if call.key_scores is None:
        return False
    rows, buf = plan.scores[ROWS], call.key_scores
    if plan.scores.get(EVERY_ROW):  # every row of the call, in order: views, no copy
        plan.scores[layer] = (buf[:, :, 0], lse[:, :, 0])
    else:
        plan.scores[layer] = (buf[rows, :, 0], lse[rows, :, 0])
    return True


def record_from_pages(kv, plan, layer: int, q_rows: torch.Tensor, scale: float | None) -> None:
    """``plan.scores[layer]`` from the asked rows of ``q_rows (T, Hq, 1, D)`` (the step's
    tokens as rows, their K/V already written) and their sequences' gathered keys, in float32:
    the C kernel's scores where it does not run."""
    rows = plan.scores.get(ROWS)
    if rows is None:
        return
    Hq, D = q_rows.shape[1], q_rows.shape[3]
    scale = D**-0.5 if scale is None else scale
    L = plan.block_table.shape[1] * kv.page_size
    out = torch.full((len(rows), Hq, L), float("-inf"), device=q_rows.device)
    for i, t in enumerate(rows.tolist()):
        n = int(plan.seq_lens[t])
        k = kv.gather(plan.seq_ids[t], layer)[0][:, :n].float()  # (Hkv, n, D)
        q = q_rows[t, :, 0].float().view(k.shape[0], -1, D)  # (Hq, D) -> (Hkv, G, D)
        out[i, :, :n] = (q @ k.transpose(1, 2) * scale).reshape(Hq, n)  # (Hkv, G, n) -> (Hq, n)
    plan.scores[layer] = (out, torch.logsumexp(out, dim=-1))
