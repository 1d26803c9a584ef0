"""``selfattn generate [MODEL] PROMPT``: continue a text prompt with a checkpoint folder, a GGUF
file or a Hub id (default: the bundled SmolLM2-135M-Instruct) through
:func:`selfattn.models.generate`, the tokenizer read by :func:`selfattn.models.load_tokenizer`,
streaming the text to stdout as it is produced. It stops at the model's end tokens (end of turn
included) unless ``--ignore-eos``."""

from __future__ import annotations

import sys

from selfattn.cli import _common

CACHES = ("auto", "static", "window", "paged")
DEFAULT_MAX_NEW_TOKENS = 64  # without --max-new-tokens or the model's own limit


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate",
        help="continue a text prompt with a checkpoint (its tokenizer and chat template)",
        description=(
            "Load MODEL (a folder with config.json, safetensors weights and tokenizer.json, a "
            ".gguf file, or a Hugging Face Hub id in the local cache; default: the bundled "
            "SmolLM2-135M-Instruct) and continue PROMPT, printing the new text as it is "
            "generated, until the model's end token or --max-new-tokens."
        ),
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=_common.CHAT_MODEL_HELP)  # fmt: skip
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=_common.positive_int,
        default=None,
        metavar="N",
        help=f"at most N new tokens (default: the model's generation config, else "
        f"{DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT as one user message in the checkpoint's chat template",
    )
    p.add_argument("--cache", choices=CACHES, default="auto",
                   help="KV cache (default auto: paged where its steps take the decode fast "
                   "path, else static)")  # fmt: skip
    _common.add_dtype(p)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    _common.add_sampling(p)
    p.add_argument("--ignore-eos", action="store_true",
                   help="run on to --max-new-tokens past the model's end tokens")  # fmt: skip
    p.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


class TextStream:
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

    from selfattn.models import generate
    from selfattn.models.generate import generation_defaults

    if not args.prompt.strip():
        args.subparser.error("PROMPT must be non-empty text")
    _common.apply_threads(args)
    model, tokenizer, _ = _common.load_chat_model(args.model, args.dtype, args.quantize)
    max_new = args.max_new_tokens or generation_defaults(model).get("max_new_tokens")
    text = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    streamer = None if args.no_stream else TextStream(tokenizer, sys.stdout)
    with torch.inference_mode():
        out = generate(
            model,
            text,
            max_new or DEFAULT_MAX_NEW_TOKENS,
            tokenizer=tokenizer,
            cache=args.cache,
            ignore_eos=args.ignore_eos,
            streamer=streamer,
            **_common.sampling_kwargs(args, sample=args.sample),
        )
    if streamer is None:
        print(out)
    return _common.EXIT_OK
