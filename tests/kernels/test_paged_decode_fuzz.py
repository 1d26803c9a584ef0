"""Adversarial grid for the C paged-decode kernel (``paged_attention(backend="cpu")``), as vLLM's
and FlashInfer's decode tests would try it: random combinations, each sequence checked against
the float64 oracle on its own K/V gathered through the table, by the ratio rule (out and lse).

Each case draws, from a seeded generator: page sizes 1/3/8/16/32, ragged lengths (Sq, exactly
whole pages, one past a page, up to a few hundred), Sq 1..16, head sizes 64/80/96/112/120/128/256
and odd ones (3, 17, 59) with Dv != D, GQA ratios 1..8, page dtypes fp32/bf16/fp16/int8/fp8
with fp32/bf16/fp16 queries, block tables permuted, shared between sequences or repeating a
page, junk past each sequence's pages and NaN/Inf in every slot no row may read, pages that
are strided views of one fused K|V pool, the kernel's masks (causal, windows, chunked,
prefix-LM, padding, StreamingLLM's sinks | window union), sinks, the scale, the instruction-set
path (``SELFATTN_DECODE_ISA``: every one this CPU runs) and a planned step
(``PagedAttentionPlan``: the kernel's ``Launch``). The case is in the test id.

``SELFATTN_FUZZ_SEED`` / ``SELFATTN_FUZZ_CASES`` widen the hunt (default: ``CASES`` cases of
one fixed seed, ~10 s).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.backends.paged.plan import PagedAttentionPlan
from selfattn.cache import paged_attention
from selfattn.kernels import paged_decode
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests.cache.test_paged import make_paged
from tests.kernels.test_paged_decode_isa import _pages, _paths

pytestmark = pytest.mark.c_kernel(paged_decode)

SEED = int(os.environ.get("SELFATTN_FUZZ_SEED", "16"))
CASES = int(os.environ.get("SELFATTN_FUZZ_CASES", "40"))
HEAD_DIMS = [64, 80, 96, 112, 120, 128, 256, 3, 17, 59]
STORAGES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUERY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # queries of quantised pages
MASKS = ["none", "causal", "window", "streaming", "chunked", "prefix_lm", "causal&padding"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One random paged call, drawn without tensors (so that it can name its test)."""

    seed: int
    P: int
    lens: tuple[int, ...]
    Hq: int
    Hkv: int
    D: int
    Dv: int
    Sq: int
    storage: str
    qdtype: str
    table: str  # permuted, shared (pages repeated across and within sequences)
    poison: bool  # NaN/Inf wherever no row may read, junk ids past each sequence's pages
    fused_pool: bool  # k and v pages: strided views of one (N, P, Hkv, D + Dv) pool
    mask: str
    window: int
    sinks: bool
    scale: float | None
    isa: str
    planned: bool

    def __str__(self):
        lens = ",".join(map(str, self.lens))
        return (
            f"P{self.P}-lens{lens}-Sq{self.Sq}-H{self.Hq}/{self.Hkv}-D{self.D}/{self.Dv}-"
            f"{self.storage}-q{self.qdtype}-{self.table}{'-poison' if self.poison else ''}"
            f"{'-fused' if self.fused_pool else ''}-{self.mask}{self.window}"
            f"{'-sinks' if self.sinks else ''}-scale{self.scale}-{self.isa}"
            f"{'-planned' if self.planned else ''}"
        )


def draw(i: int, seed: int = SEED) -> Case:
    r = random.Random(seed * 1_000_003 + i)
    P = r.choice([1, 3, 8, 16, 32])
    Sq = r.choice([1, 1, 1, 2, 3, 7, 16])
    lens = tuple(
        max(
            Sq,
            r.choice(
                [Sq, Sq + 1, P * r.randrange(1, 9), P * r.randrange(1, 5) + 1, r.randrange(1, 300)]
            ),
        )
        for _ in range(r.choice([1, 2, 3, 5]))
    )
    Hkv = r.choice([1, 2, 3, 4])
    D = r.choice(HEAD_DIMS)
    storage = r.choice(["fp32", "bf16", "bf16", "fp16", "int8", "fp8"])
    qdtype = storage if storage in STORAGES else r.choice(list(QUERY_DTYPES))
    float_pages = storage in STORAGES
    return Case(
        seed=seed * 1_000_003 + i, P=P, lens=lens, Hq=Hkv * r.choice([1, 2, 4, 5, 8]), Hkv=Hkv,
        D=D, Dv=D if r.random() < 0.7 else r.choice(HEAD_DIMS), Sq=Sq, storage=storage,
        qdtype=qdtype, table=r.choice(["permuted", "shared"]),
        # fp8 scales are per head over the whole pool: NaN anywhere would poison them
        poison=float_pages and r.random() < 0.4, fused_pool=float_pages and r.random() < 0.3,
        mask=r.choice(MASKS), window=r.choice([1, 2, P, P + 1, 37, 1000]),
        sinks=r.random() < 0.2, scale=r.choice([None, None, 0.3]), isa=r.choice(_paths()),
        planned=r.random() < 0.3,
    )  # fmt: skip


def _tables(case: Case, g: torch.Generator, N: int, max_pages: int) -> torch.Tensor:
    table = torch.full((len(case.lens), max_pages), -1, dtype=torch.int32)
    perm = torch.randperm(N, generator=g)
    for b, n in enumerate(case.lens):
        used = math.ceil(n / case.P)
        if case.table == "shared" and b > 0:  # any page, repeats included (a shared prefix)
            table[b, :used] = torch.randint(0, N, (used,), generator=g, dtype=torch.int32)
        else:
            table[b, :used] = perm[b * max_pages : b * max_pages + used].int()
    return table


def _poison(case: Case, kp, vp, table, junk: int) -> None:
    """NaN/Inf in pages no sequence uses and in slots past each sequence's length (where no other
    sequence reads them), junk block ids past each sequence's used pages."""
    P, used = case.P, [math.ceil(n / case.P) for n in case.lens]
    read = {int(table[b, j]): b for b, u in enumerate(used) for j in range(u)}
    for pid in range(kp.shape[0]):
        if pid not in read:
            kp[pid], vp[pid] = math.nan, math.inf
    for b, (n, u) in enumerate(zip(case.lens, used)):
        table[b, u:] = junk
        last, tail = int(table[b, u - 1]), n - (u - 1) * P
        shared = any(int(table[c, j]) == last for c, cu in enumerate(used) if c != b
                     for j in range(cu))  # fmt: skip
        if tail < P and not shared and last not in table[b, : u - 1].tolist():
            kp[last, tail:], vp[last, tail:] = math.nan, -math.inf


def _mask(case: Case, pick):
    """The call's mask given ``pick(values)``: per-sequence values as a tensor, or one of them."""
    n_sink = min(4, min(case.lens))
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(case.window),
        "streaming": masks.causal()
        & (masks.padding(n_sink) | (~masks.padding(pick([min(n, 2) for n in case.lens]))
                                    & masks.sliding_window(case.window))),
        "chunked": masks.chunked(case.window),
        "prefix_lm": masks.prefix_lm(pick([min(5, n) for n in case.lens])),
        "causal&padding": masks.causal() & masks.padding(pick([max(1, n - 3) for n in case.lens])),
    }[case.mask]  # fmt: skip


def build(case: Case):
    """``(q, k_pages, v_pages, table, seq_lens, kwargs)`` of the case."""
    g = torch.Generator().manual_seed(case.seed % 2**31)
    q, kp, vp, _, lens = make_paged(
        list(case.lens), case.Hq, case.Hkv, D=case.D, P=case.P, Sq=case.Sq, Dv=case.Dv,
        dtype=torch.float64, seed=case.seed % 2**31,
    )  # fmt: skip
    N, max_pages = kp.shape[0], max(math.ceil(n / case.P) for n in case.lens) + 1
    table = _tables(case, g, N, max_pages)
    if case.poison:
        _poison(case, kp, vp, table, junk=[-1, 2**31 - 1, N][case.seed % 3])
    if case.fused_pool:
        pool = torch.cat([kp, vp], dim=-1).to(STORAGES[case.storage])
        kp, vp, ks, vs = pool[..., : case.D], pool[..., case.D :], None, None
    else:
        kp, vp, ks, vs = _pages(case.storage, kp, vp)
    q = q.to(STORAGES[case.qdtype])
    kwargs = dict(
        mask=_mask(case, lambda values: torch.tensor(values)), scale=case.scale, k_scales=ks,
        v_scales=vs, sinks=torch.randn(case.Hq, generator=g) if case.sinks else None,
    )  # fmt: skip
    return q, kp, vp, table, lens, kwargs


def _sequence(pages, scales, table, b: int, n: int) -> torch.Tensor:
    """Sequence ``b``'s first ``n`` keys (or values) in float64, dequantised: ``(1, Hkv, n, ·)``."""
    x = pages.double()
    if scales is not None:
        x = x * (scales.double().unsqueeze(-1) if scales.dim() == 3 else scales.double()[:, None])
    used = math.ceil(n / pages.shape[1])
    rows = x[table[b, :used].long()].reshape(-1, *x.shape[2:])[:n]  # (n, Hkv, ·)
    return rows.transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize("case", [draw(i) for i in range(CASES)], ids=str)
def test_random_decode_calls_match_the_fp64_oracle(case: Case, monkeypatch):
    if case.storage == "fp16" and torch.float16 not in paged_decode.supported_dtypes():
        pytest.skip("this compiler has no _Float16")
    monkeypatch.setenv("SELFATTN_DECODE_ISA", case.isa)
    q, kp, vp, table, lens, kwargs = build(case)
    why = sa.backends.explain_paged(q, kp, vp, table, lens, print_table=False, **kwargs)
    assert why.reasons["cpu"] is None, f"{case}: the C kernel declined: {why.reasons['cpu']}"
    plan = PagedAttentionPlan(table, lens) if case.planned else None
    out, lse = paged_attention(
        q, kp, vp, table, lens, backend="cpu", return_lse=True, plan=plan, **kwargs
    )
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], case.Dv)
    for b, n in enumerate(case.lens):
        k = _sequence(kp, kwargs["k_scales"], table, b, n)
        v = _sequence(vp, kwargs["v_scales"], table, b, n)
        kw = dict(mask=_mask(case, lambda values, b=b: values[b]), scale=case.scale,
                  sinks=kwargs["sinks"])  # fmt: skip
        o64, l64, _ = reference_attention(q[b : b + 1], k, v, **kw)
        on, ln, _ = naive_attention(q[b : b + 1], k.to(q.dtype), v.to(q.dtype), **kw)
        assert_close_to_reference(out[b : b + 1], o64, on, dtype=q.dtype, what=f"out[{b}]")
        assert_close_to_reference(lse[b : b + 1], l64, ln, dtype=torch.float32, what=f"lse[{b}]")


def test_long_sequences_split_over_the_keys_match_the_oracle():
    """One sequence of 5,000 keys on pages of 16 with a batch of 1: split into many key ranges
    merged in float32 (flash-decoding), bf16 pages, GQA 8, a window reaching across splits."""
    q, kp, vp, table, lens = make_paged([5000], 16, 2, D=128, P=16, Sq=2, seed=60)
    kp, vp, q = kp.bfloat16(), vp.bfloat16(), q.bfloat16()
    mask = masks.sliding_window(3000)
    out = paged_attention(q, kp, vp, table, lens, mask=mask, backend="cpu")
    k, v = _sequence(kp, None, table, 0, 5000), _sequence(vp, None, table, 0, 5000)
    o64, _, _ = reference_attention(q, k, v, mask=mask)
    on, _, _ = naive_attention(q, k.to(q.dtype), v.to(q.dtype), mask=mask)
    assert_close_to_reference(out, o64, on)


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
@pytest.mark.parametrize("P", [8, 32], ids=["page-step", "general-path"])
def test_nan_scores_reach_the_rows_that_attend_them(P, storage, monkeypatch):
    """A NaN key score makes out and lse NaN for the rows attending that key, as the PyTorch
    path gives, on every instruction-set path. The kernel took a row whose split sum was NaN
    for a row with no key (out 0, lse -inf: ``sum > 0`` is false for NaN), and skipped a page
    whose attended scores were all NaN. P = 8: pages take the fused page step; 32: the general
    path."""
    for isa in _paths():
        monkeypatch.setenv("SELFATTN_DECODE_ISA", isa)
        q, kp, vp, table, lens = make_paged([70, 5], 4, 2, D=16, P=P, Sq=1, seed=62)
        kp[int(table[0, 0]), 2, 0, 3] = math.nan  # one key of 70, kv head 0
        kp[int(table[1, 0]), 4, 1, 3] = math.nan  # sequence 1's last key, kv head 1
        dtype = STORAGES[storage]
        q, kp, vp = q.to(dtype), kp.to(dtype), vp.to(dtype)
        for mask in (None, masks.sliding_window(1)):  # window 1: only the NaN key, for seq 1
            kw = dict(mask=mask, return_lse=True)
            out, lse = paged_attention(q, kp, vp, table, lens, backend="cpu", **kw)
            ref, ref_lse = paged_attention(q, kp, vp, table, lens, backend="torch", **kw)
            assert bool(torch.isnan(ref_lse).any()), isa
            assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), isa
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), isa
            torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num())


# -- bad input ---------------------------------------------------------------------------------


def _call(Sq=1, **change):
    q, kp, vp, table, lens = make_paged([max(9, Sq), 20], 4, 2, D=16, P=4, Sq=Sq, seed=61)
    args = dict(q=q, k_pages=kp, v_pages=vp, block_table=table, seq_lens=lens)
    for name, fn in change.items():
        args[name] = fn(args)
    return args


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"block_table": lambda a: a["block_table"].index_fill(1, torch.tensor([1]), 99)},
         r"block_table\[0, 1\]=99 is out of range for N=\d+ pages"),
        ({"seq_lens": lambda a: torch.tensor([9, 0], dtype=torch.int32)},
         r"seq_lens\[1\]=0 is smaller than Sq=1"),
        ({"seq_lens": lambda a: torch.tensor([9, 99], dtype=torch.int32)},
         r"seq_lens\[1\]=99 exceeds the capacity max_pages × P = 6 × 4 = 24"),
        ({"k_pages": lambda a: a["k_pages"].bfloat16()},
         r"share one dtype, got torch\.float32, torch\.bfloat16 and torch\.float32"),
        ({"k_pages": lambda a: a["k_pages"][..., :8]}, r"q has head dim D=16 but k_pages has D=8"),
        ({"q": lambda a: a["q"][:, :3]}, r"Hkv=2 must divide Hq=3"),
        ({"k_pages": lambda a: a["k_pages"].to(torch.int8)}, r"k_scales"),
        ({"block_table": lambda a: a["block_table"].float()}, r"block_table must be an integer"),
        ({"v_pages": lambda a: a["v_pages"].to(torch.float8_e5m2)},
         r"v_pages are torch\.float8_e5m2: fp8 pages must be float8_e4m3fn"),
    ],
    ids=["page-id", "short-seq", "capacity", "dtype-mix", "head-dim", "gqa", "int8-no-scales",
         "float-table", "fp8-e5m2"],
)  # fmt: skip
def test_bad_inputs_name_the_values_and_the_fix(change, says):
    with pytest.raises((TypeError, ValueError), match=says):
        paged_attention(**_call(**change), backend="cpu")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"Sq": 17}, r"Sq=17 > 16"),
        ({"v_pages": lambda a: a["v_pages"].transpose(0, 3).contiguous().transpose(0, 3)},
         r"last dim is not contiguous"),
        ({"q": lambda a: a["q"].double(), "k_pages": lambda a: a["k_pages"].double(),
          "v_pages": lambda a: a["v_pages"].double()}, r"float64 queries"),
    ],
    ids=["long-chunk", "strided-rows", "float64"],
)  # fmt: skip
def test_what_the_kernel_declines_names_the_reason(change, says):
    args = _call(**change) if "Sq" not in change else _call(Sq=change["Sq"])
    with pytest.raises(ValueError, match=says):
        paged_attention(**args, backend="cpu")
    paged_attention(**args)  # auto runs it elsewhere
