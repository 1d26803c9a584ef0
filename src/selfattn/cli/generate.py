"""``selfattn generate``: continue a text prompt with a checkpoint folder (or Hub id) through
:func:`selfattn.models.generate`, the tokenizer read by :func:`selfattn.models.load_tokenizer`,
streaming the text to stdout as it is produced."""

from __future__ import annotations

import sys

from selfattn.cli import _common

CACHES = ("static", "window", "paged")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate",
        help="continue a text prompt with a checkpoint (its tokenizer and chat template)",
        description=(
            "Load MODEL (a folder with config.json, safetensors weights and tokenizer.json, or a "
            "Hugging Face Hub id in the local cache) and continue PROMPT, printing the new text "
            "as it is generated."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub id")
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=_common.positive_int, default=64, metavar="N")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT as one user message in the checkpoint's chat template",
    )
    p.add_argument("--cache", choices=CACHES, default="static", help="KV cache (default static)")
    p.add_argument("--dtype", default="auto", help="weights dtype: auto, bfloat16, float32, ...")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=_common.positive_int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    p.set_defaults(run=run, subparser=p)
    return p


class _TextStream:
    """transformers' streamer protocol (``put`` gets the prompt first, then each step's token;
    ``end``): decodes the new tokens so far and writes what was not yet written."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.written = 0
        self.prompt_seen = False

    def put(self, tokens) -> None:
        if not self.prompt_seen:  # the prompt: not echoed
            self.prompt_seen = True
            return
        self.ids += tokens.reshape(-1).tolist()
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        self.out.write(text[self.written :])
        self.out.flush()
        self.written = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def run(args) -> int:
    import torch

    from selfattn.models import from_pretrained, generate, load_tokenizer

    if not args.prompt.strip():
        args.subparser.error("PROMPT must be non-empty text")
    with _common.spinner(f"loading {args.model}"):
        model = from_pretrained(args.model, dtype=args.dtype, progress=False)
        tokenizer = load_tokenizer(args.model)
    text = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    streamer = None if args.no_stream else _TextStream(tokenizer, sys.stdout)
    with torch.inference_mode():
        out = generate(
            model,
            text,
            args.max_new_tokens,
            tokenizer=tokenizer,
            cache=args.cache,
            do_sample=args.sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=torch.Generator().manual_seed(args.seed) if args.sample else None,
            streamer=streamer,
        )
    if streamer is None:
        print(out)
    return _common.EXIT_OK
