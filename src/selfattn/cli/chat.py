"""``selfattn chat [MODEL]``: a conversation in the terminal with a chat model (default: the
bundled SmolLM2-135M-Instruct), its reply streamed token by token.

Each turn renders the whole conversation through the checkpoint's chat template and generates
until the model's end-of-turn token (:func:`selfattn.models.generate.stop_token_ids`). Commands:
``/reset`` (forget the conversation), ``/system TEXT`` (a new system message; the conversation
starts over), ``/exit`` (or end of input). Ctrl-C stops the reply being written and keeps the
session; at the prompt, a second Ctrl-C in a row ends it.

With stdin not a terminal (``echo "hi" | selfattn chat``) every line is one user turn, the replies
go to stdout one per turn, and no prompt or terminal control is written.
"""

from __future__ import annotations

import sys

from selfattn.cli import _common

PROMPT = ">>> "
HELP = "/reset: new conversation  /system TEXT: set the system message  /exit: quit"
DEFAULT_MAX_NEW_TOKENS = 512  # a reply's length without the model's own limit (it stops at eot)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal (default: the bundled SmolLM2-135M-Instruct)",
        description=(
            "A conversation with MODEL through its chat template, the reply streamed as it is "
            f"generated. {HELP}; Ctrl-C stops a reply. Piped stdin: one turn per line."
        ),
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=_common.CHAT_MODEL_HELP)  # fmt: skip
    p.add_argument(
        "--max-new-tokens",
        type=_common.positive_int,
        default=None,
        metavar="N",
        help="longest reply in tokens (default: the model's generation config, else "
        f"{DEFAULT_MAX_NEW_TOKENS}; a reply ends at the model's end-of-turn token)",
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="the system message")
    _common.add_sampling(p)
    _common.add_dtype(p)
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


class Conversation:
    """The messages so far and how one reply is generated from them.

    ``reply(text, out)`` adds the user message, streams the reply to ``out`` and adds it; a
    conversation that outgrows the model's context drops its oldest turns (the system message
    stays)."""

    def __init__(self, model, tokenizer, *, system: str | None, max_new_tokens: int | None,
                 sampling: dict):  # fmt: skip
        from selfattn.models.generate import generation_defaults

        self.model, self.tokenizer, self.system = model, tokenizer, system
        defaults = generation_defaults(model)
        self.max_new_tokens = max_new_tokens or defaults.get("max_new_tokens")
        self.max_new_tokens = self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.sampling = sampling
        config = getattr(model, "config", None)
        self.context = getattr(config, "max_positions", None)
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.messages = []

    def _prompt_ids(self) -> list[int]:
        """The conversation through the chat template, oldest turns dropped to leave room."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        while True:
            ids = self.tokenizer.apply_chat_template(
                head + self.messages, add_generation_prompt=True, tokenize=True
            )
            room = None if self.context is None else self.context - len(ids)
            if room is None or room >= min(self.max_new_tokens, 64) or len(self.messages) <= 1:
                return ids
            self.messages = self.messages[2:]  # the oldest user turn and its reply

    def reply(self, text: str, out) -> str:
        """Answer ``text``, writing the reply to ``out`` as it comes; returns it. Ctrl-C stops
        the reply; what was written stays in the conversation."""
        import torch

        from selfattn.cli.generate import TextStream
        from selfattn.models import generate

        self.messages.append({"role": "user", "content": text})
        ids = self._prompt_ids()
        max_new = self.max_new_tokens
        if self.context is not None:
            if len(ids) >= self.context:
                self.messages.pop()
                raise ValueError(
                    f"the message takes {len(ids)} tokens with the chat template; the model's "
                    f"context holds {self.context}: send a shorter one"
                )
            max_new = min(max_new, self.context - len(ids))
        stream = TextStream(self.tokenizer, out)
        try:
            with torch.inference_mode():
                generate(self.model, torch.tensor([ids]), max_new, tokenizer=self.tokenizer,
                         streamer=stream, **self.sampling)  # fmt: skip
        except KeyboardInterrupt:
            out.write(" [stopped]\n")
            out.flush()
        answer = self.tokenizer.decode(stream.ids, skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def _read_line(interactive: bool) -> str | None:
    """The next line of input (None at its end); raises KeyboardInterrupt on Ctrl-C."""
    if interactive:
        try:
            return input(PROMPT)
        except EOFError:
            print(file=sys.stderr)
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(args) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        import contextlib

        with contextlib.suppress(ImportError):  # line editing and history where it exists
            import readline  # noqa: F401
    _common.apply_threads(args)
    model, tokenizer, name = _common.load_chat_model(args.model, args.dtype, args.quantize)
    if getattr(tokenizer, "chat_template", None) is None:
        _common.print_error(
            f"{name} has no chat template (none in its tokenizer files); use "
            "`selfattn generate MODEL PROMPT` to continue plain text"
        )
        return _common.EXIT_FAILURE
    chat = Conversation(model, tokenizer, system=args.system,
                        max_new_tokens=args.max_new_tokens,
                        sampling=_common.sampling_kwargs(args))  # fmt: skip
    if interactive:
        print(f"{name}: {HELP}; Ctrl-C stops a reply", file=sys.stderr)
    interrupted = False  # the last prompt ended in Ctrl-C
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            if interrupted or not interactive:
                print(file=sys.stderr)
                return _common.EXIT_OK
            interrupted = True
            print("\n(Ctrl-C again or /exit to quit)", file=sys.stderr)
            continue
        interrupted = False
        if line is None:
            return _common.EXIT_OK
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command in ("/exit", "/quit", "/bye"):
                return _common.EXIT_OK
            if command == "/reset":
                chat.reset()
                _note("(conversation reset)", interactive)
                continue
            if command == "/system":  # without TEXT: no system message
                chat.system = rest.strip() or None
                chat.reset()
                _note("(system message set; conversation reset)", interactive)
                continue
            if command in ("/help", "/?"):
                _note(HELP, interactive)
                continue
            _common.print_error(f"unknown command {command!r}; {HELP}")
            continue
        try:
            chat.reply(text, sys.stdout)
        except ValueError as e:  # this turn only: the session goes on
            _common.print_error(str(e))


def _note(text: str, interactive: bool) -> None:
    """A command's confirmation: on stderr at a terminal, nothing in a pipe."""
    if interactive:
        print(text, file=sys.stderr)
