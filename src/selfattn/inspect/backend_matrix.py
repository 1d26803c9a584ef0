"""What each registered backend can run: its ``reject()`` verdict on small probe cases.

``capability_matrix()`` changes one feature at a time (a mask, a score mod, GQA, dropout,
gradients, a dtype, the device) of one small base case and records, per backend, ``None`` (it can
run) or its reason, and what ``auto`` picks. ``matrix_markdown()`` lays it out as the table of
docs/attention.md (``selfattn backends --matrix --markdown``). ``variants_matrix()`` /
``variants_markdown()`` do the same for the attention variants of today's open models (sinks,
softcap, MLA, differential attention, QK-norm, chunked local layers, the StreamingLLM cache),
dense and paged, forward and backward (``selfattn backends --variants --markdown``, the table
of docs/variants.md). ``backend_availability()`` is each backend's verdict on one plain case on
this machine (``selfattn info``).
"""

from __future__ import annotations

import torch

from selfattn import backends, masks, scores

__all__ = [
    "PROBE",
    "backend_availability",
    "capability_matrix",
    "matrix_markdown",
    "variants_markdown",
    "variants_matrix",
]

# The base case: B=1, Hq=4, Sq=Sk=33, D=16, fp32, CPU, causal, no grad; each probe changes one
# feature of it, and each backend's reject() gives the verdict.
PROBE = {"B": 1, "Hq": 4, "S": 33, "D": 16}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _probe_cases() -> list[tuple[str, dict]]:
    """``(label, change)``: the one change to the base case that asks for each feature."""
    B, Hq, S = PROBE["B"], PROBE["Hq"], PROBE["S"]
    m, s = masks, scores
    return [
        ("no mask", {"mask": None}),
        ("causal", {}),
        ("sliding_window", {"mask": m.sliding_window(8)}),
        ("causal & documents", {"mask": m.causal() & m.documents(torch.arange(S) // 10)}),
        ("padding", {"mask": m.padding([S - 5] * B)}),
        ("mask_mod callable", {"mask": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 == 0}),
        ("bool tensor mask", {"mask": torch.rand(S, S, generator=_gen()) > 0.5}),
        ("score_mod: alibi", {"score_mod": s.alibi(Hq)}),
        (
            "score_mod: bias tensor",
            {"score_mod": torch.randn(1, Hq, S, S, generator=_gen(), dtype=torch.float32)},
        ),
        ("score_mod: softcap", {"score_mod": s.softcap(20.0)}),
        ("score_mod callable", {"score_mod": lambda sc, b, h, q_idx, kv_idx: sc * 0.5}),
        ("GQA (Hq=4, Hkv=2)", {"Hkv": 2}),
        ("MQA (Hq=4, Hkv=1)", {"Hkv": 1}),
        ("decode (Sq=1, Sk=33)", {"Sq": 1}),
        ("Dv != D", {"Dv": 24}),
        ("dropout_p=0.1", {"dropout_p": 0.1}),
        ("grad", {"grad": True}),
        ("return_lse", {"return_lse": True}),
        ("return_lse + grad", {"return_lse": True, "grad": True}),
        ("float16", {"dtype": torch.float16}),
        ("bfloat16", {"dtype": torch.bfloat16}),
        ("float64", {"dtype": torch.float64}),
        ("cuda", {"device": "cuda"}),
    ]


def capability_matrix() -> dict:
    """Per probe feature, each backend's ``reject()`` verdict: None (can run) or its reason.

    ``{"probe": PROBE, "backends": sorted names, "features": [{"feature", "auto", "reasons"}]}``;
    a feature this machine cannot probe (``cuda`` without a device) has ``"skipped"`` instead.
    """
    names = sorted(backends.names())  # registration order depends on import order
    features = []
    for label, change in _probe_cases():
        c = {"Hkv": PROBE["Hq"], "Sq": PROBE["S"], "Dv": PROBE["D"], "grad": False}
        c |= {"dtype": torch.float32, "device": "cpu", "mask": masks.causal()} | change
        if c["device"] == "cuda" and not torch.cuda.is_available():
            features.append({"feature": label, "skipped": "no CUDA device on this machine"})
            continue
        g, (B, Hq, S, D) = _gen(), PROBE.values()
        q = torch.randn(B, Hq, c["Sq"], D, generator=g).to(c["device"], c["dtype"])
        k = torch.randn(B, c["Hkv"], S, D, generator=g).to(c["device"], c["dtype"])
        v = torch.randn(B, c["Hkv"], S, c["Dv"], generator=g).to(c["device"], c["dtype"])
        for t in (q, k, v):
            t.requires_grad_(c["grad"])
        kwargs = {n: c[n] for n in ("mask", "score_mod", "dropout_p", "return_lse") if n in c}
        explanation = backends.explain(q, k, v, print_table=False, **kwargs)
        features.append(
            {"feature": label, "auto": explanation.chosen, "reasons": explanation.reasons}
        )
    return {"probe": PROBE, "backends": names, "features": features}


def matrix_markdown(matrix: dict) -> str:
    """The capability matrix as a Markdown table: ``yes`` / ``no``, auto's pick in bold."""
    names = matrix["backends"]
    lines = ["| feature | " + " | ".join(f"`{n}`" for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for f in matrix["features"]:
        if "skipped" in f:
            cells = ["not probed (no CUDA device)"] * len(names)
        else:
            cells = [
                ("**yes**" if f.get("auto") == n else "yes")
                if f["reasons"].get(n) is None
                else "no"
                for n in names
            ]
        lines.append(f"| {f['feature']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the variants: what each dense and paged backend runs, forward and backward -------

# The variant probes' sizes: MLA's latent of R plus its rope key of DR (D = R + DR, Dv = R on the
# absorbed path; K of NOPE + DR and V of R per head on the naive one), a StreamingLLM cache of
# N_SINK sinks and a window of WINDOW, Llama-4's chunks of CHUNK, the paged probe's page size.
_R, _DR, _NOPE, _N_SINK, _WINDOW, _CHUNK, _PAGE = 16, 8, 16, 4, 8, 8, 16


def _variant_cases() -> list[tuple[str, dict | None, dict | None]]:
    """``(variant, dense change, paged change)`` to the base probe (causal prefill; decode, one
    query per sequence, for the paged call); None where the variant has no such call."""
    m, D = masks, PROBE["D"]
    streaming = m.causal() & (m.padding(_N_SINK) | m.sliding_window(_WINDOW))
    paged_streaming = m.causal() & (
        m.padding(_N_SINK) | (~m.padding(torch.tensor([0])) & m.sliding_window(_WINDOW))
    )
    softcap, chunks = {"score_mod": scores.softcap(20.0)}, {"mask": m.chunked(_CHUNK)}
    absorbed, diff = {"Hkv": 1, "D": _R + _DR, "Dv": _R}, {"Hkv": 2, "Dv": 2 * D}
    return [
        ("learned sinks (gpt-oss)", {"sinks": True}, {"sinks": True}),
        ("softcap (Gemma-2)", softcap, softcap),
        ("MLA, naive order (prefill, training)", {"D": _NOPE + _DR, "Dv": _R}, None),
        ("MLA, absorbed order (decode: one latent head)", absorbed | {"Sq": 1, "mask": None},
         absorbed),
        ("differential attention (DiffLlama: V of 2·D)", diff, diff),
        ("QK-norm, query temperature (plain call)", {}, {}),
        ("chunked local layers (Llama-4)", chunks, chunks),
        ("StreamingLLM cache (sinks + window)", {"mask": streaming}, {"mask": paged_streaming}),
    ]  # fmt: skip


def _variant_verdicts(change: dict, paged: bool) -> dict:
    """``{"auto", "fwd", "bwd"}``: auto's pick and each backend's reason (None: runs) without and
    with gradients for one variant's call."""
    B, Hq, S, D = PROBE.values()
    c = {"Hkv": Hq, "Sq": S, "D": D, "Dv": D, "mask": masks.causal()} | change
    explanations = []
    for grad in (False, True):
        g = _gen()
        kw = {"mask": c["mask"]} if c["mask"] is not None else {}
        if "score_mod" in c:
            kw["score_mod"] = c["score_mod"]
        if c.get("sinks"):
            kw["sinks"] = torch.randn(Hq, generator=g).requires_grad_(grad)
        if paged:
            q = torch.randn(B, Hq, 1, c["D"], generator=g)
            n_pages = -(-S // _PAGE)
            k = torch.randn(n_pages, _PAGE, c["Hkv"], c["D"], generator=g)
            v = torch.randn(n_pages, _PAGE, c["Hkv"], c["Dv"], generator=g)
            table = torch.arange(n_pages, dtype=torch.int32).view(1, -1)
            lens = torch.tensor([S], dtype=torch.int32)
            for t in (q, k, v):
                t.requires_grad_(grad)
            e = backends.explain_paged(q, k, v, table, lens, print_table=False, **kw)
        else:
            q = torch.randn(B, Hq, c["Sq"], c["D"], generator=g).requires_grad_(grad)
            k = torch.randn(B, c["Hkv"], S, c["D"], generator=g).requires_grad_(grad)
            v = torch.randn(B, c["Hkv"], S, c["Dv"], generator=g).requires_grad_(grad)
            e = backends.explain(q, k, v, print_table=False, **kw)
        explanations.append(e)
    fwd, bwd = explanations
    return {"auto": fwd.chosen, "fwd": fwd.reasons, "bwd": bwd.reasons}


def variants_matrix() -> dict:
    """Per variant, each dense and paged backend's verdict on its call (CPU, fp32), without and
    with gradients: ``{"probe", "backends", "paged_backends", "variants": [{"variant",
    "dense", "paged"}]}`` with ``{"auto", "fwd", "bwd"}`` reasons (None: runs) or None where the
    variant has no such call."""
    variants = []
    for label, dense, paged in _variant_cases():
        variants.append({
            "variant": label,
            "dense": None if dense is None else _variant_verdicts(dense, paged=False),
            "paged": None if paged is None else _variant_verdicts(paged, paged=True),
        })  # fmt: skip
    return {
        "probe": PROBE,
        "backends": sorted(backends.names()),
        "paged_backends": sorted(backends.registry("paged").names()),
        "variants": variants,
    }


def _variant_cell(verdicts: dict | None, name: str) -> str:
    if verdicts is None:
        return "–"
    fwd, bwd = verdicts["fwd"].get(name) is None, verdicts["bwd"].get(name) is None
    cell = "fwd+bwd" if fwd and bwd else ("fwd" if fwd else "no")
    return f"**{cell}**" if verdicts["auto"] == name else cell


def variants_markdown(matrix: dict) -> str:
    """The variants matrix as a Markdown table: ``fwd+bwd`` / ``fwd`` (inference only) / ``no``
    per backend (``paged:`` the ``paged_attention`` backends, decode), auto's pick in bold, ``–``
    where the variant has no such call."""
    dense, paged = matrix["backends"], matrix["paged_backends"]
    heads = [f"`{n}`" for n in dense] + [f"paged `{n}`" for n in paged]
    lines = ["| variant | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for v in matrix["variants"]:
        cells = [_variant_cell(v["dense"], n) for n in dense]
        cells += [_variant_cell(v["paged"], n) for n in paged]
        lines.append(f"| {v['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backend_availability() -> list[dict]:
    """Each backend's doc and its verdict on a plain case here (fp32 causal, CPU or CUDA):
    ``available`` and, when not, ``why_not`` (the backend's own ``reject`` reason)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = _gen()
    q, k, v = (
        torch.randn(1, 4, 64, 32, generator=g, dtype=torch.float32).to(device) for _ in range(3)
    )
    reasons = backends.explain(q, k, v, mask=masks.causal(), print_table=False).reasons
    return [
        {
            "name": n,
            "doc": backends.get(n).doc,
            "available": reasons.get(n) is None,
            "why_not": reasons.get(n),
        }
        for n in backends.names()
    ]
