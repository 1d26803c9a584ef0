"""Argument checks that every rank of a group passes or fails together.

A collective call (ring attention, an all-gather) blocks until every rank of the group joins it.
If one rank's arguments fail a check and it raises, the others wait in the next collective until
the process group's timeout (30 minutes for gloo). So each public entry point runs its argument
checks inside :func:`rank_checks`, which then makes ONE small all-gather before any other
collective: every rank sends whether its checks passed and a fixed-size summary of its arguments
(shapes, dtype, options). Every rank then knows whether any rank failed, or whether the ranks
disagree, and raises the same :class:`DistributedArgumentError`, naming the ranks and their
messages; only on that failure path does a second all-gather carry the messages' text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DistributedArgumentError", "dtype_code", "dtype_name", "rank_checks"]

MAX_MESSAGE_BYTES = 2000  # of each failing rank's message; the rest is cut (a long mask repr)
_OK, _FAILED = 0, 1
# Every dtype torch has, in a fixed order: a summary names a dtype by its index here.
_DTYPES = sorted({t for t in vars(torch).values() if isinstance(t, torch.dtype)}, key=str)


class DistributedArgumentError(ValueError):
    """An argument check failed on some ranks of a collective call, or the ranks' arguments
    disagree. Raised on EVERY rank of the group (before any blocking collective), so that none
    of them waits for the others until the process-group timeout.

    ``failures``: ``{rank: message}`` of the ranks whose checks failed (empty when the ranks
    passed their checks but disagree).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype)


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "?"


def _rank_list(ranks: list[int]) -> str:
    """``[0, 2, 3, 4]`` -> ``"ranks 0, 2-4"`` (a failure shared by 64 ranks stays one line)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _by_value(per_rank: dict[int, object]) -> list[tuple[list[int], object]]:
    """``[(ranks, value), ...]``: the ranks holding each distinct value, in order of first rank."""
    groups: dict = {}
    for r, value in sorted(per_rank.items()):
        groups.setdefault(value, []).append(r)
    return [(ranks, value) for value, ranks in groups.items()]


def _device(group, hint) -> torch.device:
    """Where the exchange's tensors live: NCCL only moves CUDA tensors (on the rank's own GPU: the
    call's tensors' device, else the current one); every other backend (gloo, mpi,
    "cpu:gloo,cuda:nccl") moves CPU ones."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if isinstance(hint, torch.Tensor) and hint.is_cuda:
        return hint.device
    return torch.device("cuda", torch.cuda.current_device())


def _all_gather(values: torch.Tensor, group, W: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(values) for _ in range(W)]
    dist.all_gather(parts, values, group=group)
    return [p.cpu() for p in parts]


def rank_checks(
    what: str, group, W: int, n: int, describe, hint: str = "", *, tensor=None
) -> _RankChecks:
    """Run a call's argument checks on every rank; raise on all of them if any rank fails.

    ::

        with rank_checks("ring_attention", group, W, 16, describe, hint) as check:
            ...                          # argument checks: raise as usual
            check.summary = [...]        # 16 ints: shapes, dtype codes, options
        ...                              # every rank passed, with equal summaries

    On exit every rank all-gathers its status and summary (one collective). If a check raised
    on any rank (an ``Exception`` inside the block), or the summaries differ, every rank raises
    :class:`DistributedArgumentError`: the failing ranks' messages, or each distinct summary
    through ``describe(summary) -> str`` followed by ``hint``. With ``W == 1`` there is no one
    to wait, and a check's exception propagates unchanged. ``tensor``: one of the call's
    arguments, whose GPU the exchange uses under NCCL.
    """
    return _RankChecks(what, group, W, n, describe, hint, tensor)


class _RankChecks:
    def __init__(self, what: str, group, W: int, n: int, describe, hint: str, tensor):
        self.what, self.group, self.W, self.n = what, group, W, n
        self.describe, self.hint, self.tensor = describe, hint, tensor
        self.summary: list[int] | None = None

    def __enter__(self) -> _RankChecks:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if self.W == 1 or (exc is not None and not isinstance(exc, Exception)):
            return False  # no peers, or an interrupt (KeyboardInterrupt, SystemExit)
        failed = exc is not None
        if not failed:
            assert self.summary is not None and len(self.summary) == self.n, self.summary
        text = f"{type(exc).__name__}: {exc}".encode()[:MAX_MESSAGE_BYTES] if failed else b""
        summary = [0] * self.n if failed else self.summary
        device = _device(self.group, self.tensor)
        mine = torch.tensor([_FAILED if failed else _OK, len(text), *summary], device=device)
        rows = [row.tolist() for row in _all_gather(mine, self.group, self.W)]
        if any(row[0] == _FAILED for row in rows):
            raise self._failure(rows, text, device) from exc
        summaries = {r: tuple(row[2:]) for r, row in enumerate(rows)}
        if len(set(summaries.values())) > 1:
            lines = [
                f"{_rank_list(rs)}: {self.describe(list(s))}" for rs, s in _by_value(summaries)
            ]
            raise DistributedArgumentError(
                f"{self.what} needs the same arguments on every rank of the group, got:\n  "
                + "\n  ".join(lines)
                + (f"\n{self.hint}" if self.hint else "")
            )
        return False

    def _failure(self, rows, text: bytes, device) -> DistributedArgumentError:
        """Every rank's message (a second all-gather, padded to the longest) in one error."""
        longest = max(row[1] for row in rows)
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        texts = _all_gather(mine, self.group, self.W)
        failures = {
            r: bytes(texts[r][: row[1]].tolist()).decode(errors="replace")
            for r, row in enumerate(rows)
            if row[0] == _FAILED
        }
        ranks = sorted(failures)
        lines = [f"{_rank_list(rs)}: {msg}" for rs, msg in _by_value(failures)]
        return DistributedArgumentError(
            f"{self.what}: the arguments failed a check on {_rank_list(ranks)} of the "
            f"{self.W} ranks (every rank raises this error):\n  " + "\n  ".join(lines),
            failures,
        )
