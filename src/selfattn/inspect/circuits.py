"""Causal analyses on the hook points (:mod:`selfattn.inspect.hooks`): the logit lens, direct
logit attribution, activation patching, and induction / previous-token heads with ablations.

Each runs a few forwards of the model it is given (batched where one forward can carry several
edits) and returns plain tensors in small dataclasses; :mod:`selfattn.inspect.claim` measures
how far attention-based importance predicts these causal effects.

>>> lens = logit_lens(model, ids)                       # doctest: +SKIP
>>> lens.top_ids[-1, 0, -1]                             # the last layer's top tokens = the model's
>>> report = induction_heads(model, ablate=5)           # doctest: +SKIP
>>> report.table()[:3]                                  # rows by induction score
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from selfattn._validate import positive_int
from selfattn.inspect.hooks import hook_points, hooks
from selfattn.nn.norms import RMSNorm

__all__ = [
    "DirectLogitAttribution",
    "InductionReport",
    "LogitLens",
    "Patching",
    "activation_patching",
    "attention_heads",
    "direct_logit_attribution",
    "induction_heads",
    "logit_difference",
    "logit_lens",
    "repeated_tokens",
]


def _unembed(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(model, "unembed", None)
    if fn is None:
        raise ValueError(
            f"{type(model).__name__} has no unembed(h): the logit lens and logit attribution "
            "need a causal LM (selfattn.models decoders and hybrids)"
        )
    return fn


def attention_heads(model: nn.Module) -> list[tuple[int, int]]:
    """``(block index, query heads)`` of every block with an attention layer, in order."""
    points = hook_points(model)
    out = []
    for name, p in points.items():
        if name.startswith("blocks.") and name.endswith(".attn.hook_z"):
            out.append((int(name.split(".")[1]), p.module.n_heads))
    if not out:
        raise ValueError(f"{type(model).__name__} has no attention blocks to analyse")
    return out


def _n_blocks(model: nn.Module) -> int:
    return sum(1 for n in hook_points(model) if n.endswith(".hook_resid_post"))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _ids(input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a (B, S) int tensor, got {got}")
    return input_ids


def _steps(items, desc: str, progress: bool):
    if not progress:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


# -- the logit lens -------------------------------------------------------------------------------


@dataclass
class LogitLens:
    """Per layer, the next-token distribution read from the residual stream through the final
    norm and unembedding. ``layers[i]`` labels entry ``i``: ``"embed"`` (the stream entering
    block 0), then ``"0"``, ``"1"``, ... (the stream after that block; the last is the model's
    own logits). ``top_ids``/``top_probs``: ``(layers, B, S, k)``; with ``answer``,
    ``answer_rank`` (0 = top) and ``answer_prob``: ``(layers, B, S)``."""

    layers: list[str]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    answer_rank: torch.Tensor | None = None
    answer_prob: torch.Tensor | None = None

    def as_json(self, tokenizer=None, batch: int = 0) -> list[dict]:
        """One object per layer: ``{"layer", "positions": [{"top": [[token, prob], ...],
        "answer_rank", "answer_prob"}]}`` (tokens as text with a tokenizer, else ids)."""
        out = []
        for i, name in enumerate(self.layers):
            rows = []
            for s in range(self.top_ids.shape[2]):
                ids = self.top_ids[i, batch, s].tolist()
                toks = [tokenizer.decode([t]) for t in ids] if tokenizer is not None else ids
                row = {"top": [[t, p] for t, p in zip(toks, self.top_probs[i, batch, s].tolist())]}
                if self.answer_rank is not None:
                    row["answer_rank"] = int(self.answer_rank[i, batch, s])
                    row["answer_prob"] = float(self.answer_prob[i, batch, s])
                rows.append(row)
            out.append({"layer": name, "positions": rows})
        return out


@torch.no_grad()
def logit_lens(
    model: nn.Module, input_ids: torch.Tensor, *, top: int = 5, answer=None
) -> LogitLens:
    """The logit lens of ``model`` on ``input_ids (B, S)`` (:class:`LogitLens`). ``answer``: a
    token id, ``(B,)`` ids or ``(B, S)`` ids (e.g. the next tokens) whose rank and probability
    are tracked at every layer and position."""
    unembed, x = _unembed(model), _ids(input_ids)
    positive_int(top, "top")
    n = _n_blocks(model)
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(n)]
    with hooks(model, capture=names) as cache:
        model(x)
    B, S = x.shape
    if answer is not None:
        answer = torch.as_tensor(answer, device=x.device).long()
        answer = answer.view(-1, 1).expand(B, S) if answer.dim() <= 1 else answer
        if answer.shape != (B, S):
            raise ValueError(
                f"answer must be a token id, (B={B},) ids or (B={B}, S={S}) ids, got shape "
                f"{tuple(answer.shape)}"
            )
    tops, probs, ranks, aprobs = [], [], [], []
    for name in names:
        logp = torch.log_softmax(unembed(cache[name]).float(), dim=-1)  # (B, S, V)
        p, i = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops.append(i)
        probs.append(p.exp())
        if answer is not None:
            a = logp.gather(-1, answer.unsqueeze(-1))  # (B, S, 1)
            ranks.append((logp > a).sum(-1))
            aprobs.append(a.squeeze(-1).exp())
    stack = lambda xs: torch.stack(xs) if xs else None  # noqa: E731
    return LogitLens(["embed"] + [str(i) for i in range(n)], stack(tops), stack(probs),
                     stack(ranks), stack(aprobs))  # fmt: skip


# -- direct logit attribution ---------------------------------------------------------------------


@dataclass
class DirectLogitAttribution:
    """Each component's direct contribution to a logit (or a logit difference) at one position,
    averaged over the batch, through the final norm frozen at its scale of the run: ``heads``
    ``(blocks, H)`` (NaN where a block has no attention), ``attn_bias`` and ``mlp`` ``(blocks,)``
    (a recurrent block's mixer output: ``mixer``), ``embed``. ``total`` is their sum and
    ``logit`` the model's (pre-soft-cap) value: equal up to rounding, less ``norm_bias`` (a
    LayerNorm's bias term, not attributed)."""

    heads: torch.Tensor
    attn_bias: torch.Tensor
    mlp: torch.Tensor
    mixer: torch.Tensor
    embed: float
    norm_bias: float
    total: float
    logit: float


def _frozen_norm(norm: nn.Module, whole: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    """The final norm as a linear map at the statistics of ``whole (B, d)`` (its scale frozen):
    ``(f, bias)`` with ``norm(whole) = f(whole) + bias``."""
    w = getattr(norm, "weight", None)
    w = torch.ones(whole.shape[-1], dtype=whole.dtype, device=whole.device) if w is None else w
    if isinstance(norm, nn.LayerNorm):
        sigma = (whole.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        bias = norm.bias if norm.bias is not None else torch.zeros_like(w)
        return lambda c: w * (c - c.mean(-1, keepdim=True)) / sigma, bias
    if not isinstance(norm, RMSNorm):
        raise ValueError(
            f"direct logit attribution linearises the final norm: RMSNorm and LayerNorm are "
            f"known, {type(norm).__name__} is not"
        )
    rms = (whole.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    return lambda c: w * c / rms, torch.zeros_like(w)


def _head_outputs(att, z: torch.Tensor) -> torch.Tensor:
    """Each head's write ``(B, H, d)`` to the stream from its ``z (B, H, Dv)`` at one position:
    the out projection of that head's slice alone (any linear module; its bias apart)."""
    B, H, Dv = z.shape
    eye = torch.eye(H, dtype=z.dtype, device=z.device)
    per = (eye.view(1, H, H, 1) * z.view(B, 1, H, Dv)).reshape(B, H, H * Dv)
    zero = att.out_proj(torch.zeros_like(per[:, :1]))  # the bias (B, 1, d)
    return att.out_proj(per) - zero


@torch.no_grad()
def direct_logit_attribution(
    model: nn.Module, input_ids: torch.Tensor, target, *, other=None, position: int = -1
) -> DirectLogitAttribution:
    """Attribute the logit of ``target`` (a token id or ``(B,)`` ids; minus that of ``other``
    when given: a logit difference) at ``position`` to every head, MLP and the embedding
    (:class:`DirectLogitAttribution`). A block whose attention output passes a norm of its own
    (Gemma-2's post-norm) is refused: its heads' writes are not linear."""
    x = _ids(input_ids)
    _unembed(model)  # a causal LM, or the error that says so
    points = hook_points(model)
    n = _n_blocks(model)
    for name, p in points.items():
        if name.endswith(".hook_attn_out") and p.module is not _inner(points, name):
            raise ValueError(
                f"{name}: the attention output passes a norm before the stream (post-norm "
                "sublayers): heads do not add linearly, so direct attribution is not defined"
            )
    ends = (".hook_z", ".hook_mlp_out", ".hook_mixer_out")
    wanted = [n for n in points if n.endswith(ends)]
    wanted += ["blocks.0.hook_resid_pre", f"blocks.{n - 1}.hook_resid_post"]
    with hooks(model, capture=wanted, positions=[position % x.shape[1]]) as c:
        model(x)
    whole = c[f"blocks.{n - 1}.hook_resid_post"][:, 0]  # (B, d)
    f, bias = _frozen_norm(model.norm, whole)
    B, W = x.shape[0], unembed_matrix(model)
    t = torch.as_tensor(target, device=x.device).long().expand(B)
    u = W[t].to(whole.dtype)  # (B, d)
    if other is not None:
        u = u - W[torch.as_tensor(other, device=x.device).long().expand(B)].to(whole.dtype)
    dot = lambda part: (f(part) * u).sum(-1).mean().item()  # noqa: E731
    heads_of = dict(attention_heads(model))
    H = max(heads_of.values())
    heads = torch.full((n, H), float("nan"), dtype=torch.float64)
    attn_bias, mlp, mixer = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    for i in range(n):
        if i in heads_of:
            att = points[f"blocks.{i}.attn.hook_z"].module
            z = c[f"blocks.{i}.attn.hook_z"][:, :, 0]  # (B, H, Dv)
            writes = _head_outputs(att, z)  # (B, H, d)
            for h in range(heads_of[i]):
                heads[i, h] = dot(writes[:, h])
            attn_bias[i] = dot(att.out_proj(torch.zeros_like(z.flatten(1))))
        if f"blocks.{i}.hook_mlp_out" in c:
            mlp[i] = dot(c[f"blocks.{i}.hook_mlp_out"][:, 0])
        if f"blocks.{i}.hook_mixer_out" in c:
            mixer[i] = dot(c[f"blocks.{i}.hook_mixer_out"][:, 0])
    embed = dot(c["blocks.0.hook_resid_pre"][:, 0])
    norm_bias = (bias.to(u.dtype) * u).sum(-1).mean().item()
    total = float(heads.nan_to_num(0).sum() + attn_bias.sum() + mlp.sum() + mixer.sum()) + embed
    logits = model.lm_head(model.norm(whole))  # pre-soft-cap
    logit = logits.gather(-1, t.view(-1, 1)).squeeze(-1)
    if other is not None:
        logit = logit - logits.gather(-1, torch.as_tensor(other).long().expand(B).view(-1, 1))[:, 0]
    return DirectLogitAttribution(heads, attn_bias, mlp, mixer, embed, norm_bias, total,
                                  logit.double().mean().item())  # fmt: skip


def _inner(points, attn_out_name: str):
    """The attention module whose output is ``attn_out_name`` when nothing wraps it."""
    z = points.get(attn_out_name.replace("hook_attn_out", "attn.hook_z"))
    return None if z is None else z.module


def unembed_matrix(model: nn.Module) -> torch.Tensor:
    """The LM head as a dense ``(vocab, d)`` matrix (a quantised head applied to the identity)."""
    head = model.lm_head
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.detach()
    d = model.norm.weight.shape[0]
    eye = torch.eye(d, device=_device(model), dtype=torch.float32)
    return (head(eye) - head(torch.zeros_like(eye[:1]))).T.contiguous()


# -- activation patching --------------------------------------------------------------------------


def logit_difference(answer, wrong) -> Callable[[torch.Tensor], torch.Tensor]:
    """A patching metric: ``logit[answer] - logit[wrong]`` at the last position, per batch row
    (``answer``/``wrong``: token ids, one each or ``(B,)``)."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1].double()
        B = last.shape[0]
        a = torch.as_tensor(answer, device=last.device).long().expand(B)
        w = torch.as_tensor(wrong, device=last.device).long().expand(B)
        return last.gather(-1, a.view(-1, 1))[:, 0] - last.gather(-1, w.view(-1, 1))[:, 0]

    return metric


@dataclass
class Patching:
    """Activation patching from a clean run into a corrupted one. ``effect[l, j]`` is the
    restored share of the metric, ``(patched - corrupted) / (clean - corrupted)`` averaged over
    the batch (1: the patch restores the clean answer, 0: no effect), for head ``j`` (``over=
    "heads"``, NaN past a block's heads) or position ``j`` (``"positions"``) of block ``l``;
    ``patched`` the raw metric; ``clean`` and ``corrupted`` the unpatched runs' metrics."""

    over: str
    effect: torch.Tensor
    patched: torch.Tensor
    clean: float
    corrupted: float


@torch.no_grad()
def activation_patching(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    metric: Callable[[torch.Tensor], torch.Tensor],
    *,
    over: str = "heads",
    logits_to_keep=None,
    progress: bool = False,
) -> Patching:
    """Patch each head's output ``z`` (``over="heads"``) or the residual stream entering each
    block at each position (``"positions"``) from the clean run into the corrupted run, and
    measure ``metric(logits) -> (B,)`` (e.g. :func:`logit_difference`). One forward per block:
    the corrupted batch repeated once per head or position, each copy with its own patch.
    ``logits_to_keep`` (the model's argument: ``1`` for the last position, or positions) limits
    the logits computed to those ``metric`` reads: the LM head over every position dominates
    the cost of a short prompt with a large vocabulary."""
    keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    clean, corrupted = _ids(clean_ids), _ids(corrupted_ids)
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} prompts must "
            "have the same shape (patching pairs positions): pick corruptions of equal length"
        )
    if over not in ("heads", "positions"):
        raise ValueError(f"over must be 'heads' or 'positions', got {over!r}")
    n, (B, S) = _n_blocks(model), clean.shape
    point = "attn.hook_z" if over == "heads" else "hook_resid_pre"
    with hooks(model, capture=f"blocks.*.{point}") as cache:
        m_clean = metric(model(clean, **keep)).mean().item()
    m_bad = metric(model(corrupted, **keep)).mean().item()
    heads_of = dict(attention_heads(model))
    width = max(heads_of.values()) if over == "heads" else S
    patched = torch.full((n, width), float("nan"), dtype=torch.float64)
    for i in _steps(range(n), f"patching {over}", progress):
        name = f"blocks.{i}.{point}"
        if name not in cache:
            continue
        J = heads_of[i] if over == "heads" else S
        src = cache[name]  # heads on axis 1 of z (B, H, S, Dv); positions of (B, S, d)

        def edit(value, p, src=src, J=J):
            value = value.clone().view(J, B, *value.shape[1:])
            for j in range(J):  # copy j of the batch gets patch j
                value[j, :, j] = src[:, j]
            return value.view(J * B, *value.shape[2:])

        with hooks(model, edit={name: edit}):
            logits = model(corrupted.repeat(J, 1), **keep)
            logits = logits.view(J, B, *logits.shape[1:])
            m = torch.stack([metric(part).mean() for part in logits])  # each copy's own rows
        patched[i, :J] = m.double().cpu()
    denom = m_clean - m_bad
    effect = (patched - m_bad) / (denom if denom != 0 else float("nan"))
    return Patching(over, effect, patched, m_clean, m_bad)


# -- induction and previous-token heads -----------------------------------------------------------


def repeated_tokens(
    model: nn.Module, length: int, batch: int, *, seed: int = 0, low: int | None = None
) -> torch.Tensor:
    """``(batch, 1 + 2·length)``: a start token (the model's BOS, else a random token) then
    ``length`` random tokens twice. Tokens come from ``[low, vocab)``, past the special ids at
    the bottom of most vocabularies (``low`` default: 1/8 of the vocabulary, at most 1000)."""
    V = model.config.vocab_size
    low = min(1000, V // 8) if low is None else low
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(low, V, (batch, length), generator=g)
    bos = getattr(model, "bos_token_id", None)
    start = torch.full((batch, 1), int(bos) if isinstance(bos, int) else int(half[0, 0]))
    return torch.cat((start, half, half), dim=1).to(_device(model))


def _token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-position next-token loss ``(B, S-1)``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@dataclass
class InductionReport:
    """Induction and previous-token heads of a model on repeated random tokens.

    ``induction[l, h]``: mean attention from each token of the repeated half to the token after
    its earlier occurrence (prefix matching); ``prev_token[l, h]``: mean attention to the token
    before; ``copying[l, h]``: the OV circuit's copying score (Olsson et al. 2022: the share of
    its eigenvalues' real parts that are positive, ``Σ Re λ / Σ |λ|`` of ``W_U W_O W_V W_E``
    with the norms' gains, 1 for a pure copier); NaN past a block's heads. ``loss_first`` and
    ``loss_repeated``: the mean next-token loss on each half (in-context learning lowers the
    second). ``ablation`` (with ``ablate=k``): the repeated-half loss with the top-k induction
    heads mean-ablated, and the mean and spread over seeds of ``k`` random heads of the same
    blocks."""

    induction: torch.Tensor
    prev_token: torch.Tensor
    copying: torch.Tensor
    loss_first: float
    loss_repeated: float
    ablation: dict = field(default_factory=dict)

    def table(self, *, threshold: float = 0.3) -> list[dict]:
        """One row per head, by induction score: ``layer``, ``head``, ``induction``,
        ``prev_token``, ``copying``, ``is_induction`` (score >= ``threshold``)."""
        rows = []
        L, H = self.induction.shape
        for layer in range(L):
            for h in range(H):
                s = float(self.induction[layer, h])
                if s != s:  # NaN: no such head
                    continue
                rows.append({"layer": layer, "head": h, "induction": s,
                             "prev_token": float(self.prev_token[layer, h]),
                             "copying": float(self.copying[layer, h]),
                             "is_induction": s >= threshold})  # fmt: skip
        return sorted(rows, key=lambda r: -r["induction"])


def copying_scores(model: nn.Module) -> torch.Tensor:
    """The OV copying score of every head, ``(blocks, H)`` (:class:`InductionReport`)."""
    points = hook_points(model)
    V = model.config.vocab_size
    E = model.embed(torch.arange(V, device=_device(model))).detach().double()  # (V, d), any kind
    U = unembed_matrix(model).double()  # (V, d)
    gf = getattr(model.norm, "weight", None)
    K = E.T @ (U * (1 if gf is None else gf.detach().double()))  # (d, d): Σ_t e_t (γ_f ⊙ u_t)ᵀ
    heads_of = dict(attention_heads(model))
    n = _n_blocks(model)
    out = torch.full((n, max(heads_of.values())), float("nan"), dtype=torch.float64)
    for i, H in heads_of.items():
        att = points[f"blocks.{i}.attn.hook_z"].module
        block = points[f"blocks.{i}.hook_resid_pre"].module
        norm = block.self_res.norm if hasattr(block, "self_res") else block.attn_res.norm
        g = getattr(norm, "weight", None)
        eye = torch.eye(E.shape[1], dtype=model.norm.weight.dtype, device=E.device)[None]
        # the value and out projections as matrices: each applied to the identity, less its bias
        v = att.heads_qkv(eye)[2] - att.heads_qkv(torch.zeros_like(eye[:, :1]))[2]  # (1,Hkv,d,Dv)
        Dv, G = v.shape[-1], H // v.shape[1]
        eye_o = torch.eye(H * Dv, dtype=eye.dtype, device=E.device)
        Wo = att.out_proj(eye_o) - att.out_proj(torch.zeros_like(eye_o[:1]))  # (H·Dv, d)
        for h in range(H):
            wv = v[0, h // G].double().T  # (Dv, d): W_V of the head
            if g is not None:
                wv = wv * g.detach().double()
            wo = Wo[h * Dv : (h + 1) * Dv].double()  # (Dv, d): W_Oᵀ of the head
            lam = torch.linalg.eigvals(wv @ K @ wo.T)  # (Dv, Dv)
            out[i, h] = (lam.real.sum() / lam.abs().sum().clamp_min(1e-300)).item()
    return out


@torch.no_grad()
def induction_heads(
    model: nn.Module,
    *,
    length: int = 40,
    batch: int = 8,
    seed: int = 0,
    ablate: int = 0,
    random_seeds: int = 5,
    input_ids: torch.Tensor | None = None,
) -> InductionReport:
    """Score every head on ``batch`` sequences of ``length`` random tokens repeated twice
    (:func:`repeated_tokens`, or ``input_ids`` of that form) and, with ``ablate=k``, compare
    mean-ablating the top-k induction heads with ``k`` random heads of the same blocks over
    ``random_seeds`` draws (:class:`InductionReport`)."""
    x = (
        _ids(input_ids)
        if input_ids is not None
        else repeated_tokens(model, length, batch, seed=seed)
    )
    T = (x.shape[1] - 1) // 2
    if x.shape[1] != 2 * T + 1 or not torch.equal(x[:, 1 : T + 1], x[:, T + 1 :]):
        raise ValueError("input_ids must be a start token then a sequence repeated twice")
    heads_of = dict(attention_heads(model))
    n = _n_blocks(model)
    H = max(heads_of.values())
    induction = torch.full((n, H), float("nan"), dtype=torch.float64)
    prev = induction.clone()
    q = torch.arange(T + 1, 2 * T + 1)  # the repeated half's queries
    allq = torch.arange(1, 2 * T + 1)
    with hooks(model, capture=["blocks.*.attn.hook_pattern", "blocks.*.attn.hook_z"]) as c:
        logits = model(x)
    for i, h in heads_of.items():
        p = c[f"blocks.{i}.attn.hook_pattern"].double()  # (B, H, S, S)
        # the token after the earlier occurrence: key q - T + 1 for query q
        induction[i, :h] = p[:, :, q, q - T + 1].mean((0, 2)).cpu()
        prev[i, :h] = p[:, :, allq, allq - 1].mean((0, 2)).cpu()
    # position t predicts token t+1: positions 1..T-1 the first half's, T+1..2T-1 the repeat's
    # (the start token's and position T's next tokens are random either way)
    loss = _token_loss(logits, x)  # (B, 2T)
    first, repeated = loss[:, 1:T].mean().item(), loss[:, T + 1 :].mean().item()
    report = InductionReport(induction, prev, copying_scores(model), first, repeated)
    if ablate:
        report.ablation = _ablation(model, x, c, report, positive_int(ablate, "ablate"),
                                    random_seeds, seed, heads_of)  # fmt: skip
    return report


def _mean_z_ablation(cache, heads: Sequence[tuple[int, int]]) -> dict:
    """Edits replacing each chosen head's ``z`` by its mean over the batch and positions."""
    by_block: dict[int, list[int]] = {}
    for i, h in heads:
        by_block.setdefault(i, []).append(h)
    edits = {}
    for i, hs in by_block.items():
        mean = cache[f"blocks.{i}.attn.hook_z"].mean((0, 2), keepdim=True)  # (1, H, 1, Dv)

        def edit(value, point, hs=hs, mean=mean):
            value = value.clone()
            value[:, hs] = mean[:, hs].to(value.dtype)
            return value

        edits[f"blocks.{i}.attn.hook_z"] = edit
    return edits


def _ablation(model, x, cache, report, k, seeds, seed, heads_of) -> dict:
    T = (x.shape[1] - 1) // 2
    top = [(r["layer"], r["head"]) for r in report.table()[:k]]

    def repeated_loss(heads) -> float:
        with hooks(model, edit=_mean_z_ablation(cache, heads)):
            return _token_loss(model(x), x)[:, T + 1 :].mean().item()

    rng = random.Random(seed)
    chosen = set(top)
    rand = []
    for _ in range(seeds):
        pick = []
        for i, _h in top:  # a random head of the same block, not one of the top heads
            others = [h for h in range(heads_of[i]) if (i, h) not in chosen and (i, h) not in pick]
            if others:
                pick.append((i, rng.choice(others)))
        rand.append(repeated_loss(pick))
    r = torch.tensor(rand, dtype=torch.float64)
    return {
        "k": k,
        "heads": top,
        "loss_repeated": report.loss_repeated,
        "loss_top_ablated": repeated_loss(top),
        "loss_random_ablated_mean": r.mean().item(),
        "loss_random_ablated_std": r.std().item() if len(rand) > 1 else 0.0,
        "random_seeds": seeds,
    }
