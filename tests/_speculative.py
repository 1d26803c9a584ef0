"""Shared by the speculative decoding tests: tiny random Llamas and a chi-square test."""

from __future__ import annotations

import torch

from selfattn.models.decoder import Llama

MIN_EXPECTED = 5  # chi-square cells expecting fewer samples are pooled into one


def tiny_llama(seed: int, vocab: int = 97, layers: int = 2, d_model: int = 48) -> Llama:
    """A random Llama of GQA 6/2 heads, norms moved off their init."""
    torch.manual_seed(seed)
    cfg = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": d_model,
        "intermediate_size": 76, "num_hidden_layers": layers, "num_attention_heads": 6,
        "num_key_value_heads": 2, "max_position_embeddings": 256,
    }  # fmt: skip
    model = Llama.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (same
    shape, any), cells expecting fewer than :data:`MIN_EXPECTED` samples pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    small = expected < MIN_EXPECTED
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # a sample where the distribution puts no mass
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def exact_joint(model, prompt: list[int], n: int, probs_fn=None, **processing) -> torch.Tensor:
    """The exact distribution ``(V,) * n`` of the first ``n`` sampled tokens after ``prompt``
    (temperature / top-k / top-p as ``generate``'s, or ``probs_fn(logits, **processing)``), by
    full forwards over every prefix."""
    from selfattn.models.generate import token_probs

    probs_fn = token_probs if probs_fn is None else probs_fn
    V = model.config.vocab_size
    joint = torch.ones(())
    prefixes = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(prefixes)[:, -1].double()
            p = probs_fn(logits, **processing).double()  # (V^i, V)
            joint = (joint.reshape(-1, 1) * p).reshape(*(V,) * (joint.dim() + 1))
            prefixes = torch.cat(
                [prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]],
                dim=1,
            )
    return joint
