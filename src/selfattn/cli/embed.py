"""``selfattn embed``: sentence embeddings of all-MiniLM-L6-v2 through
:class:`selfattn.models.SentenceEncoder`, and their cosine-similarity matrix."""

from __future__ import annotations

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2) and their cosine-similarity matrix",
        description="Encode each TEXT with selfattn.models.SentenceEncoder and compare them.",
    )
    p.add_argument("texts", nargs="+", metavar="TEXT", help="sentences to embed")
    p.add_argument("--model", metavar="PATH", help=_common.MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print embeddings and similarities as JSON")
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


def _similarity(encoder, sentences: list[str]) -> dict:
    import torch

    with torch.inference_mode(), _common.spinner(f"encoding {len(sentences)} sentence(s)"):
        emb = encoder.encode(sentences)  # (n, dim)
    unit = torch.nn.functional.normalize(emb.double(), dim=-1)
    return {"embeddings": emb, "similarity": (unit @ unit.T).tolist()}  # (n, n) cosines


def _short(text: str, n: int = 32) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def run(args) -> int:
    _common.apply_threads(args)
    if any(not s.strip() for s in args.texts):
        args.subparser.error("TEXT arguments must be non-empty sentences")
    encoder = _common.load_encoder(args.model)
    result = _similarity(encoder, args.texts)
    emb, sim = result["embeddings"], result["similarity"]
    if args.json:
        _common.print_json(
            {
                "sentences": args.texts,
                "dim": emb.shape[1],
                "embeddings": emb.tolist(),
                "similarity": sim,
            }
        )
        return _common.EXIT_OK
    out = _common.Printer()
    n = len(args.texts)
    out.line(f"{n} sentence(s) -> embeddings ({n}, {emb.shape[1]}), all-MiniLM-L6-v2 via selfattn")
    labels = [f"{i + 1}. {_short(t)}" for i, t in enumerate(args.texts)]
    out.table(
        ["cosine similarity", *(str(i + 1) for i in range(n))],
        [[labels[i], *(f"{x:.3f}" for x in sim[i])] for i in range(n)],
    )
    if n > 1:
        i, j = max(
            ((i, j) for i in range(n) for j in range(i + 1, n)), key=lambda p: sim[p[0]][p[1]]
        )
        out.line(f"most similar: {i + 1} and {j + 1} ({sim[i][j]:.3f})")
    return _common.EXIT_OK
