"""How far attention explains: attention-based head importance against causal effect, per head.

For the induction, capital-city and IOI tasks (:mod:`selfattn.inspect.claim`) on the bundled
SmolLM2-135M-Instruct (dense float32 weights), every head gets three attention-based scores
(attention to the answer's tokens, rollout, |attention x gradient|) and two causal effects
(mean ablation of its output; restoring it from a clean run into a corrupted one, IOI only).
The table is Spearman's rank correlation of each score with the size of each effect over all
heads, and the known result on repeated random tokens (Olsson et al. 2022): induction heads
past the first blocks, and ablating the top ones against as many random heads of the same
blocks. ``--quick`` runs a tiny random Llama (the numbers mean nothing; the plumbing runs).
``--plot FILE`` draws each score against the ablation effect.
"""

from __future__ import annotations

import argparse
import time

import torch

from selfattn.benchmarks import _util

_COLUMNS = ["task", "attention score", "causal effect", "Spearman rho", "heads"]


def _model(quick: bool):
    if quick:
        from selfattn.models.decoder import DecoderConfig, Llama

        torch.manual_seed(0)
        cfg = DecoderConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2,
                            d_ff=64)  # fmt: skip
        return Llama(cfg).eval(), None, "tiny random Llama"
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.models.bundled import chat_model_path

    path = str(chat_model_path())
    model = from_pretrained(path, dtype=torch.float32, progress=False, quantized=False).eval()
    return model, load_tokenizer(path), "SmolLM2-135M-Instruct (float32)"


def run(args) -> dict:
    from selfattn.inspect.circuits import induction_heads
    from selfattn.inspect.claim import (
        attention_vs_effect,
        factual_task,
        induction_task,
        ioi_task,
    )

    model, tok, name = _model(args.quick)
    t0 = time.perf_counter()
    ind = induction_heads(model, length=args.length, batch=args.batch, ablate=args.ablate,
                          random_seeds=args.random_seeds)  # fmt: skip
    t_ind = time.perf_counter() - t0
    tasks = [induction_task(model, length=args.length // 2, batch=args.batch)]
    if tok is not None:
        tasks += [factual_task(tok), ioi_task(tok, n=args.ioi)]
    t0 = time.perf_counter()
    claim = attention_vs_effect(model, tasks)
    t_claim = time.perf_counter() - t0
    rows = [{**r, "heads": len(claim.heads)} for r in claim.table()]
    found = [r for r in ind.table() if r["is_induction"]]
    setup = {
        "model": name,
        "tasks": {
            n: {"examples": t["examples"], "metric": t["metric"]} for n, t in claim.tasks.items()
        },
        "induction_heads": [(r["layer"], r["head"], round(r["induction"], 3)) for r in found],
        "loss_first_half": ind.loss_first,
        "loss_repeated_half": ind.loss_repeated,
        "ablation": ind.ablation,
        "seconds": {"induction_heads": round(t_ind, 1), "claim": round(t_claim, 1)},
    }
    if args.plot:
        _plot(claim, args.plot)
        setup["plot"] = args.plot
    return {"machine": _util.machine(), "setup": setup, "rows": rows}


def _plot(claim, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(claim.tasks)
    fig, axes = plt.subplots(len(names), 3, figsize=(11, 3.2 * len(names)), squeeze=False)
    for row, task in zip(axes, names):
        t = claim.tasks[task]
        effect = t["effects"]["ablation"].abs()
        for ax, score in zip(row, ("attention", "rollout", "attention_x_gradient")):
            ax.scatter(t["scores"][score], effect, s=8, alpha=0.6)
            rho = t["spearman"][(score, "ablation")]
            ax.set_title(f"{task}: {score} (rho {rho:.2f})", fontsize=9)
            ax.set_xlabel(score, fontsize=8)
            ax.set_ylabel("|ablation effect|", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(report: dict) -> list[list[str]]:
    return [[r["task"], r["score"], r["effect"], f"{r['spearman']:+.3f}", str(r["heads"])]
            for r in report["rows"]]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny random model: a smoke run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--length", type=int, default=40, help="random tokens per half (40)")
    p.add_argument("--batch", type=int, default=8, help="repeated sequences (8)")
    p.add_argument("--ablate", type=int, default=5, help="top induction heads ablated (5)")
    p.add_argument("--random-seeds", type=int, default=5, help="random-head draws (5)")
    p.add_argument("--ioi", type=int, default=8, help="IOI prompts (8)")
    p.add_argument("--plot", metavar="FILE", help="draw scores against ablation effects")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.length, args.batch, args.random_seeds = 8, 2, 2
    _util.print_report(run(args), args.json, _COLUMNS, _table, "Attention vs causal effect")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
