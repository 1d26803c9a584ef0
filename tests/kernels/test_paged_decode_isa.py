"""The C paged-decode kernel's instruction-set paths (avx512 / avx2 / generic, picked at run time,
forced lower by ``SELFATTN_DECODE_ISA``): each against the fp64 oracle in every page dtype, the
in-register conversions exact, the output bitwise reproducible."""

from __future__ import annotations

import copy

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.cache import paged_attention
from selfattn.cache.quant import quantize_fp8, quantize_int8
from selfattn.kernels import paged_decode
from selfattn.kernels.paged_twin import paged_attention_twin
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests.cache.test_paged import contiguous, make_paged

pytestmark = pytest.mark.c_kernel(paged_decode)


def _paths() -> list[str]:
    """Every path this CPU runs: the best and each one below it (generic always)."""
    if paged_decode.library() is None:
        return ["generic"]
    best = paged_decode.ISAS.index(paged_decode.isa())
    return list(paged_decode.ISAS[: best + 1])


@pytest.fixture(params=_paths())
def isa(request, monkeypatch):
    monkeypatch.setenv("SELFATTN_DECODE_ISA", request.param)
    assert paged_decode.isa() == request.param
    return request.param


def _pages(storage: str, kp: torch.Tensor, vp: torch.Tensor):
    """``(k_pages, v_pages, k_scales, v_scales)`` in a page storage dtype."""
    if storage == "int8":
        (kq, ks), (vq, vs) = quantize_int8(kp), quantize_int8(vp)
        return kq, vq, ks, vs
    if storage == "fp8":
        (kq, ks), (vq, vs) = quantize_fp8(kp), quantize_fp8(vp)
        return kq, vq, ks, vs
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[storage]
    return kp.to(dtype), vp.to(dtype), None, None


@pytest.mark.parametrize(
    "storage, qdtype",
    [
        ("fp32", torch.float32),
        ("bf16", torch.float32),
        ("bf16", torch.bfloat16),  # vdpbf16ps where the CPU has it
        ("fp16", torch.float32),
        ("int8", torch.bfloat16),
        ("fp8", torch.float32),
        ("fp8", torch.bfloat16),  # keys converted to bf16 pairs for vdpbf16ps
    ],
    ids=["fp32", "bf16-q-fp32", "bf16", "fp16", "int8", "fp8", "fp8-q-bf16"],
)
@pytest.mark.parametrize(
    "Hq, Hkv, D, Dv, Sq",
    [(8, 2, 128, 128, 1), (6, 2, 20, 36, 3), (3, 3, 37, 7, 2), (10, 2, 64, 80, 1)],
    ids=["gqa4-d128", "gqa3-odd-d", "mha-odd", "gqa5"],
)
def test_each_path_matches_the_fp64_oracle(isa, storage, Hq, Hkv, D, Dv, Sq, qdtype):
    """Every path, page dtype and GQA group (1, 3, 4, 5 query rows per kv head: the 4/2/1-row
    blocks and their remainders), D and Dv not multiples of the vector width, ragged causal
    rows: vs the twin in float64 on the same (dequantised) pages, by the ratio rule."""
    if storage == "fp16" and torch.float16 not in paged_decode.supported_dtypes():
        pytest.skip("this compiler has no _Float16")
    seed = hash((isa, storage, Hq, D, qdtype)) % 2**31
    q, kp, vp, table, lens = make_paged([53, Sq, 29], Hq, Hkv, D=D, P=8, Sq=Sq, Dv=Dv, seed=seed)
    kp, vp, ks, vs = _pages(storage, kp, vp)
    q = q.to(qdtype)
    pos = lens.long().view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq) absolute positions
    lo, hi = (pos - 40).clamp(min=0), pos + 1  # a window: some rows start past page 0
    args = (table, lo, hi, D**-0.5, ks, vs)
    out, lse = paged_decode.decode(q, kp, vp, *args)
    o64, l64 = paged_attention_twin(q.double(), kp, vp, *args)
    naive, naive_lse = paged_attention_twin(q, kp, vp, *args, compute_dtype=qdtype)
    assert_close_to_reference(out.to(qdtype), o64, naive, dtype=qdtype)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp16", "int8", "fp8"])
def test_one_key_returns_its_value_row_exactly(isa, storage, qdtype):
    """With one allowed key its weight is exactly 1, so the output is that key's value row as
    the kernel converted it: bit-equal to PyTorch's conversion (rounded to q's dtype as PyTorch
    rounds). For fp8 the row holds all 256 byte codes: normals, subnormals, signed zeros and the
    NaN codes (NaN out in those lanes only), through the in-register exponent arithmetic (fp32
    query) or the table of their bf16 bits for vdpbf16ps (bf16 query), not the float32 lookup
    table."""
    if storage == "fp16" and torch.float16 not in paged_decode.supported_dtypes():
        pytest.skip("this compiler has no _Float16")
    g = torch.Generator().manual_seed(7)
    Dv = 256
    q = torch.randn(1, 4, 1, 16, generator=g)
    kp = torch.randn(2, 4, 2, 16, generator=g)
    if storage == "fp8":
        vp = torch.arange(256, dtype=torch.uint8).repeat(2, 4, 2, 1).view(torch.float8_e4m3fn)
        kp, ks, vs = kp.to(torch.float8_e4m3fn), torch.ones(2), torch.ones(2)
        want = vp.float()
    else:
        kp, vp, ks, vs = _pages(storage, kp, torch.randn(2, 4, 2, Dv, generator=g) * 3)
        want = vp.float() if vs is None else vp.float() * vs.unsqueeze(-1)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lo, hi = torch.tensor([[5]]), torch.tensor([[6]])  # key 5: page 1 (table[0, 1] = 0), slot 1
    out, _ = paged_decode.decode(q.to(qdtype), kp, vp, table, lo, hi, 0.25, ks, vs)
    want = want.to(qdtype)
    for h in range(4):  # query head h reads kv head h // 2
        torch.testing.assert_close(out[0, h, 0], want[0, 1, h // 2], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
def test_every_fp8_key_code_scores_exactly(isa, qdtype):
    """A key row holding every fp8 e4m3 code but the two NaNs (0 * NaN would make every score
    NaN), and query b one-hot at dim b: with one key, row b's lse is its score, code b's value
    times the scales, exactly (normals, subnormals, signed zeros), through whichever conversion
    the path uses (bf16 queries: the codes as bf16 pairs for vdpbf16ps)."""
    raw = torch.arange(256, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    codes = raw.view(torch.float8_e4m3fn)
    kp = torch.zeros(1, 4, 1, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    kp[0, 0, 0] = codes
    vp = torch.zeros(1, 4, 1, 8).to(torch.float8_e4m3fn)
    q = torch.eye(256).view(256, 1, 1, 256).to(qdtype)
    table = torch.zeros(256, 1, dtype=torch.int32)
    lo, hi = torch.zeros(256, 1, dtype=torch.long), torch.ones(256, 1, dtype=torch.long)
    ks = torch.full((1,), 0.5)
    _, lse = paged_decode.decode(q, kp, vp, table, lo, hi, 0.25, ks, torch.ones(1))
    want = codes.float() * 0.25 * 0.5
    torch.testing.assert_close(lse.view(256), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_narrow_queries_get_their_output_rounded_as_pytorch_rounds(isa, qdtype):
    """The kernel writes out in q's dtype itself (no conversion op after it). One allowed key
    makes out that key's float32 value row, so its rounding must be bit-equal to PyTorch's:
    random values, exact halfway ties of both parities, values past the dtype's range, ±inf,
    signed zeros and NaN."""
    if qdtype not in paged_decode.supported_dtypes():
        pytest.skip("this compiler has no _Float16")
    g = torch.Generator().manual_seed(11)
    Dv = 64
    row = torch.randn(Dv, generator=g) * 5
    bits = row.view(torch.int32)
    half = 0x8000 if qdtype == torch.bfloat16 else 0x1000  # a tie: half a unit in the last place
    row[:8] = (bits[:8] & ~0xFFFF | half).view(torch.float32)  # ties, odd and even neighbours
    row[8:12] = torch.tensor([7e4, -1e38, float("inf"), -float("inf")])
    row[12:15] = torch.tensor([0.0, -0.0, float("nan")])
    vp = torch.zeros(2, 4, 2, Dv)
    vp[0, 1, :] = row  # key 5: logical page 1 = physical page 0 (table[0, 1]), slot 1
    kp = torch.randn(2, 4, 2, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g).to(qdtype)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lo, hi = torch.tensor([[5]]), torch.tensor([[6]])
    out, lse = paged_decode.decode(q, kp, vp, table, lo, hi, 0.25, None, None)
    assert out.dtype == qdtype and lse.dtype == torch.float32
    want = row.to(qdtype)
    for h in range(4):
        torch.testing.assert_close(out[0, h, 0], want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.usefixtures("every_thread")
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_output_is_bitwise_reproducible(isa, storage):
    """The same call twice, two threads pulling work items in whatever order: identical bits (each
    item's sums run in a fixed order, and the splits merge in split order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, kp, vp, table, lens = make_paged([300, 77], 8, 2, D=40, P=16, Sq=2, seed=3)
        kp, vp, ks, vs = _pages(storage, kp, vp)
        pos = lens.long().view(-1, 1) - 2 + torch.arange(2)
        args = (q, kp, vp, table, torch.zeros_like(pos), pos + 1, 0.1, ks, vs)
        (o1, l1), (o2, l2) = paged_decode.decode(*args), paged_decode.decode(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.skipif("avx512_vbmi" not in _paths(), reason="this CPU has no avx512_vbmi")
@pytest.mark.parametrize("D", [128, 40], ids=["d128", "d40-tail"])
def test_fp8_byte_tables_match_the_word_table_bitwise(monkeypatch, D):
    """fp8 pages with a bf16 query: the avx512_vbmi path converts keys and values by byte tables
    (64 codes a vpermt2b), avx512_bf16 by the 128-word table, both exactly, into the same
    vdpbf16ps sums in the same order: identical bits, out and lse. Ragged lengths give pages with
    an odd count of used slots (the V pairs' missing row) and whole ones; the keys hold every fp8
    code but the NaNs."""
    q, kp, vp, table, lens = make_paged([300, 77, 16], 8, 2, D=D, P=16, Sq=1, seed=11)
    kp, vp, ks, vs = _pages("fp8", kp, vp)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN: one would make every score of its row NaN
    flat = kp.view(torch.uint8).view(-1)
    flat[: codes.numel()] = codes
    q = q.to(torch.bfloat16)
    pos = lens.long().view(-1, 1)
    args = (q, kp, vp, table, torch.zeros_like(pos), pos, D**-0.5, ks, vs)
    got = {}
    for path in ("avx512_bf16", "avx512_vbmi"):
        monkeypatch.setenv("SELFATTN_DECODE_ISA", path)
        got[path] = paged_decode.decode(*args)
    (o1, l1), (o2, l2) = got.values()
    assert torch.isfinite(l1).all()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_unknown_path_is_refused(monkeypatch):
    monkeypatch.setenv("SELFATTN_DECODE_ISA", "sse9")
    q, kp, vp, table, lens = make_paged([9], 2, 1, D=8, P=4, Sq=1, seed=1)
    with pytest.raises(ValueError, match=r"SELFATTN_DECODE_ISA='sse9'.*generic, avx2"):
        paged_decode.decode(q, kp, vp, table, lens.view(1, 1) * 0, lens.view(1, 1), 1.0, None, None)


def _streaming_mask(n_sink: int, window: int, gap: list[int]):
    """StreamingPagedKV's mask in kernel indices (selfattn/cache/streaming_paged.py): the sinks,
    or the window past each sequence's masked pinned-page tokens ``[n_sink, gap)``."""
    visible = ~masks.padding(gap) & masks.sliding_window(window)
    return masks.causal() & (masks.padding(n_sink) | visible)


@pytest.mark.parametrize("storage, qdtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_streaming_mask_runs_in_the_kernel(isa, storage, qdtype, monkeypatch):
    """StreamingLLM's paged mask (sinks | window, not one key interval per row) runs in the C
    kernel as disjoint intervals per row: explain_paged picks cpu, and its output equals the
    PyTorch path's and the fp64 oracle's by the ratio rule. Rows where the sinks and the window
    overlap (a short sequence, gap 0) count no key twice; pages between them are skipped."""
    n_sink, window, P, Sq = 3, 13, 4, 2
    lens, gap = [61, 9, 40], [4, 0, 8]  # gap: sink_pages * P once a sequence dropped pages
    seed = hash((isa, storage)) % 2**31
    q, kp, vp, table, sl = make_paged(lens, 6, 2, D=20, P=P, Sq=Sq, Dv=36, seed=seed)
    dtype = torch.bfloat16 if storage == "bf16" else torch.float32
    q, kp, vp = q.to(qdtype), kp.to(dtype), vp.to(dtype)
    mask = _streaming_mask(n_sink, window, gap)
    picked = sa.backends.explain_paged(q, kp, vp, table, sl, mask=mask, print_table=False)
    assert picked.chosen == "cpu", picked
    out = paged_attention(q, kp, vp, table, sl, mask=mask, backend="cpu")
    torch_out = paged_attention(q, kp, vp, table, sl, mask=mask, backend="torch")
    for b, n in enumerate(lens):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        kw = {"mask": _streaming_mask(n_sink, window, gap[b])}
        o64, _, _ = reference_attention(q[b : b + 1].double(), kb.double(), vb.double(), **kw)
        naive, _, _ = naive_attention(q[b : b + 1], kb, vb, **kw)
        for what, got in (("cpu", out), ("torch", torch_out)):
            assert_close_to_reference(got[b : b + 1], o64, naive, dtype=qdtype, what=f"{what}[{b}]")


@torch.no_grad()
def test_streaming_paged_cache_decodes_through_the_kernel(monkeypatch):
    """A model decoding with StreamingPagedKV (pages dropped as the window passes them): every
    decode step's layers run the C kernel, and the logits equal the full forward under the
    sink/window mask (fp64 oracle, ratio rule)."""
    from tests.cache.test_paged import spy_paged_backends
    from tests.cache.test_streaming_cache import masked_forward, tiny_llama

    n_sink, window, prefill, total = 3, 5, 7, 15
    ran = spy_paged_backends(monkeypatch)
    model = tiny_llama(seed=21, n_layers=1)
    ids = torch.randint(0, 37, (2, total), generator=torch.Generator().manual_seed(22))
    view = model.make_cache(
        "streaming", 2, prefill, n_sink=n_sink, window=window, positions="absolute", paged=True,
        page_size=2,
    )  # fmt: skip
    out = [model(ids[:, :prefill], cache=view)]
    ran.clear()
    out += [model(ids[:, t : t + 1], cache=view) for t in range(prefill, total)]
    assert set(ran) == {"cpu"} and view.cache.dropped(view.seq_ids[0]) > 0, ran
    mask = masks.padding(n_sink) | masks.sliding_window(window)
    pos = torch.arange(total)
    naive = masked_forward(model, ids, mask, pos)
    oracle = masked_forward(copy.deepcopy(model).double(), ids, mask, pos)
    assert_close_to_reference(torch.cat(out, 1), oracle, naive)


def _intervals_oracle(q, kp, vp, table, lo, hi, scale, ks, vs, compute_dtype):
    """The twin over a union of disjoint key intervals ``lo, hi (B, Sq, NI)``: each interval alone,
    joined by their log-sum-exps (an empty interval: lse -inf, weight 0)."""
    parts = [
        paged_attention_twin(q, kp, vp, table, lo[..., k], hi[..., k], scale, ks, vs,
                             compute_dtype=compute_dtype)
        for k in range(lo.shape[-1])
    ]  # fmt: skip
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    w = [torch.nan_to_num(torch.exp(p[1] - lse)).unsqueeze(-1) for p in parts]
    out = sum(wk * torch.nan_to_num(p[0]).to(w[0].dtype) for wk, p in zip(w, parts))
    return out, lse


# (lens, Hq, Hkv, D, Dv, P, Sq, window, intervals): the fused page step (pages of <= 16 slots that
# every row attends whole) and the general path (pages of 32 slots; a window's first page, which
# rows attend in part) in one call, odd slot counts on last pages (the bf16 V pairs' zero row)
_MIXED = {
    "p16-odd-window": ([83, 1, 37], 8, 2, 128, 72, 16, 1, 50, 1),
    "p32-general": ([83, 40], 8, 2, 64, 40, 32, 1, 70, 1),
    "sq3-rows-over-groups": ([61, 29], 6, 2, 48, 40, 8, 3, 200, 1),
    "four-intervals": ([97, 64], 8, 2, 64, 36, 8, 1, 0, 4),
}


@pytest.mark.parametrize(
    "storage, qdtype",
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),  # vdpbf16ps scores and V sum where the CPU has avx512_bf16
        ("int8", torch.bfloat16),
        ("fp8", torch.float32),
    ],
    ids=["fp32", "bf16", "int8", "fp8"],
)
@pytest.mark.parametrize("case", list(_MIXED))
def test_fused_and_general_pages_split_over_keys(isa, storage, qdtype, case):
    """Every path and page dtype with the fused page step and the general one in one call, each
    sequence cut into work items of 2 pages (the splits' merge; the online rescale inside an
    item), against the fp64 twin by the ratio rule: windows starting mid-page, 32-slot pages, 3
    query rows per sequence (row groups of 4 across queries and heads), rows attending 4 disjoint
    key intervals, NaN in the float pages' slots past each sequence's end (never read)."""
    lens, Hq, Hkv, D, Dv, P, Sq, window, n_int = _MIXED[case]
    seed = hash((isa, storage, case)) % 2**31
    q, kp, vp, table, sl = make_paged(lens, Hq, Hkv, D=D, P=P, Sq=Sq, Dv=Dv, seed=seed)
    kp, vp, ks, vs = _pages(storage, kp, vp)
    if kp.is_floating_point() and kp.element_size() > 1:  # slots past a sequence's end: NaN
        for b, n in enumerate(lens):
            if n % P:
                kp[table[b, n // P], n % P :] = vp[table[b, n // P], n % P :] = float("nan")
    q = q.to(qdtype)
    pos = sl.long().view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq) absolute positions
    if n_int == 1:
        lo, hi = (pos - window).clamp(min=0), pos + 1
    else:  # disjoint intervals at odd offsets, some empty for the short rows
        cuts = torch.tensor([0, 3, 11, 20, 29, 45, 52, 70])
        lo = torch.minimum(cuts[0::2].expand(*pos.shape, n_int), pos.unsqueeze(-1) + 1)
        hi = torch.minimum(cuts[1::2].expand(*pos.shape, n_int), pos.unsqueeze(-1) + 1)
        hi[..., -1] = pos + 1  # the last interval runs to the row's own position
        lo[..., -1] = torch.minimum(lo[..., -1], hi[..., -1])
    pages = int(((hi.amax() + P - 1) // P).item())
    args = (table, lo, hi, D**-0.5, ks, vs)
    out, lse = paged_decode.decode(q, kp, vp, *args, splits=((pages + 1) // 2, 2))
    oracle = _intervals_oracle if n_int > 1 else paged_attention_twin
    o64, l64 = oracle(q.double(), kp, vp, *args, compute_dtype=torch.float64)
    naive, naive_lse = oracle(q, kp, vp, *args, compute_dtype=qdtype)
    assert_close_to_reference(out.to(qdtype), o64, naive.to(qdtype), dtype=qdtype)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")


# Score offsets (in logits) of each logical page of 16 slots: rises within the fused step's slack
# on its running max (8: weights up to e^8, the max kept), rises past it (the max moved; past
# fp32 exp's range from the last max: 130), falls.
_RAMP = (0.0, 3.0, 6.5, 7.9, 25.0, 24.0, 33.5, 130.0, 10.0)


@pytest.mark.parametrize(
    "storage, qdtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.bfloat16)]
)
def test_running_max_within_and_past_its_slack(isa, storage, qdtype):
    """Scores that climb page by page (query head 0 of each kv head, and its group's rows) by less
    and by more than the fused step's slack on the running max, then fall: every path against
    the fp64 twin by the ratio rule (out and lse), with the sequence in one work item and in
    items of 2 pages (the splits' merge of maxes set past the slack). Eight ramped sequences:
    scores of 130 make each row's error the rounding of a large exponent, and the maximum over
    a few rows varies too much between two summation orders for the ratio rule."""
    Hq, Hkv, D, P = 8, 2, 64, 16
    lens = [len(_RAMP) * P] * 8 + [5 * P + 3]
    q, kp, vp, table, sl = make_paged(lens, Hq, Hkv, D=D, P=P, Sq=1, seed=hash((isa, storage)))
    G = Hq // Hkv
    for b, n in enumerate(lens):
        for j in range(-(-n // P)):
            for h in range(Hkv):  # k += t q_h0 / |q_h0|^2 * sqrt(D): q_h0's scores rise by t
                qh = q[b, h * G, 0]
                kp[table[b, j], :, h] += _RAMP[j] * qh / qh.dot(qh) * D**0.5
    kp, vp, ks, vs = _pages(storage, kp, vp)
    q = q.to(qdtype)
    lo, hi = torch.zeros(len(lens), 1, dtype=torch.int64), sl.long().view(-1, 1)
    args = (table, lo, hi, D**-0.5, ks, vs)
    o64, l64 = paged_attention_twin(q.double(), kp, vp, *args)
    naive, naive_lse = paged_attention_twin(q, kp, vp, *args, compute_dtype=qdtype)
    for splits in (None, (-(-len(_RAMP) // 2), 2)):
        out, lse = paged_decode.decode(q, kp, vp, *args, splits=splits)
        assert_close_to_reference(out.to(qdtype), o64, naive, dtype=qdtype)
        assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")


# int8 pages with a bf16 query on the best path: keys by vpdpwssd against the query in int16,
# V by vpdpwssd on int16 weights per page (csrc/paged_decode.c: scores_i8dp, page_step_i8dp).
_INT8 = {
    "gqa4-d128": ([83, 1, 37], 8, 2, 128, 128, 1),
    "gqa3-odd-d": ([61, 29], 6, 2, 40, 72, 3),  # key pieces masked, V dims past 64 in fp32
    "mha-odd": ([50, 17], 3, 3, 37, 7, 2),  # Dv under one 32-dim chunk: all of it in fp32
    "gqa5-d576": ([40], 10, 2, 576, 64, 1),  # a narrower int16 query range (int32 sums)
    "mqa": ([45, 70], 4, 1, 64, 64, 1),  # one kv head: a page's scales are one contiguous run
    # 4 and 8 kv heads: a page's scales in whole registers, each head's by word permutes
    "gqa2-hkv4": ([50, 33], 8, 4, 64, 64, 1),
    "gqa4-hkv8": ([40, 21], 32, 8, 128, 128, 1),
}


@pytest.mark.parametrize("case", list(_INT8))
@pytest.mark.parametrize("window", [None, 37], ids=["all", "window"])
def test_int8_pages_bf16_query_whole_pages(isa, case, window):
    """16-slot pages (the fused step: the V block reads all 16 slots of a page, those past the
    last token with weight 0), windows starting mid-page (that page's slots run past the page:
    the plain step), every row-group size, D and Dv tails: against the fp64 twin by the ratio
    rule. The pools' slots past each sequence hold random bytes."""
    lens, Hq, Hkv, D, Dv, Sq = _INT8[case]
    P = 16
    q, kp, vp, table, sl = make_paged(
        lens, Hq, Hkv, D=D, P=P, Sq=Sq, Dv=Dv, seed=hash(case) % 2**31
    )
    kp, vp, ks, vs = _pages("int8", kp * 3, vp)
    q = q.to(torch.bfloat16)
    pos = sl.long().view(-1, 1) - Sq + torch.arange(Sq)
    lo = torch.zeros_like(pos) if window is None else (pos - window).clamp(min=0)
    args = (table, lo, pos + 1, D**-0.5, ks, vs)
    out, lse = paged_decode.decode(q, kp, vp, *args)
    o64, l64 = paged_attention_twin(q.double(), kp, vp, *args, compute_dtype=torch.float64)
    naive, naive_lse = paged_attention_twin(q, kp, vp, *args, compute_dtype=torch.bfloat16)
    assert_close_to_reference(out, o64, naive, dtype=torch.bfloat16)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")


@pytest.mark.parametrize(
    "v_scale", [2.0**-125, 2.0**-100], ids=["weights-past-int16-reach", "tiny-in-reach"]
)
def test_int8_values_with_tiny_scales(isa, v_scale):
    """V scales near float32's smallest normal: weights times scales under 2^-112 cannot be
    brought into int16 by a float32 power of two, so that page takes the fp32 block; a little
    larger ones stay on the int16 weights. Both against the fp64 twin (relative to the tiny
    outputs, not flushed to 0)."""
    q, kp, vp, table, sl = make_paged([48, 21], 8, 2, D=64, P=16, Sq=1, seed=11)
    kp, vp, ks, vs = _pages("int8", kp, vp)
    vs = torch.full_like(vs, v_scale)
    q = q.to(torch.bfloat16)
    args = (table, torch.zeros(2, 1, dtype=torch.long), sl.long().view(-1, 1), 0.125, ks, vs)
    out, _ = paged_decode.decode(q, kp, vp, *args)
    o64, _ = paged_attention_twin(q.double(), kp, vp, *args, compute_dtype=torch.float64)
    naive, _ = paged_attention_twin(q, kp, vp, *args, compute_dtype=torch.bfloat16)
    assert o64.abs().amax() > 0 and out.abs().amax() > 0
    scale = o64.abs().amax()  # compare in units of the outputs' own size
    assert_close_to_reference(
        out.double() / scale, o64 / scale, naive.double() / scale, dtype=torch.bfloat16
    )


def test_int8_keys_with_a_nonfinite_query_row(isa):
    """A query row holding NaN or Inf cannot be scaled into int16: that sequence's keys take the
    bf16 path, which carries them into the scores of its own rows only (NaN out there, the other
    rows and sequences as the fp64 twin)."""
    q, kp, vp, table, sl = make_paged([40, 33], 8, 2, D=64, P=16, Sq=1, seed=5)
    kp, vp, ks, vs = _pages("int8", kp, vp)
    q = q.to(torch.bfloat16)
    q[0, 1, 0, 3] = float("nan")
    q[1, 6, 0, 0] = float("inf")
    args = (table, torch.zeros(2, 1, dtype=torch.long), sl.long().view(-1, 1), 0.125, ks, vs)
    out, _ = paged_decode.decode(q, kp, vp, *args)
    assert out[0, 1].isnan().all() and out[1, 6].isnan().all()
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, 1] = keep[1, 6] = False
    o64, _ = paged_attention_twin(q.double(), kp, vp, *args, compute_dtype=torch.float64)
    naive, _ = paged_attention_twin(q, kp, vp, *args, compute_dtype=torch.bfloat16)
    assert_close_to_reference(out[keep], o64[keep], naive[keep], dtype=torch.bfloat16)


def test_int8_one_key_on_a_whole_page_returns_its_value_row_exactly(isa):
    """One allowed key on a 16-slot page: its weight, 1, is exact in int16 (2^14), so the output
    is its value row times its scale, bit for bit, on the int16-weight path too."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 64, generator=g).to(torch.bfloat16)
    kp, vp, ks, vs = _pages(
        "int8", torch.randn(2, 16, 2, 64, generator=g), torch.randn(2, 16, 2, 96, generator=g)
    )
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lo, hi = torch.tensor([[16]]), torch.tensor([[17]])  # key 16: page 0 (table[0, 1]), slot 0
    out, _ = paged_decode.decode(q, kp, vp, table, lo, hi, 0.125, ks, vs)
    want = (vp[0, 0].float() * vs[0, 0].float().unsqueeze(-1)).to(torch.bfloat16)  # (Hkv, Dv)
    for h in range(4):
        torch.testing.assert_close(out[0, h, 0], want[h // 2], rtol=0, atol=0)


@pytest.mark.parametrize(
    "where, bad",
    [("k", float("nan")), ("k", float("inf")), ("k", -float("inf")), ("v", float("nan")),
     ("v", float("inf"))],
    ids=["k-nan", "k-inf", "k-neg-inf", "v-nan", "v-inf"],
)  # fmt: skip
def test_int8_nonfinite_scale_reaches_the_rows_that_attend_it(isa, where, bad):
    """A NaN or Inf int8 scale (a corrupted page) on one used slot: the rows that attend it get
    what the fp64 twin gets there (NaN), never a finite number; the other rows are as usual. On
    the int16-weight path a NaN weight would otherwise saturate to a finite integer; an Inf key
    scale times a score would be ±Inf (the key taking all the weight, or silently dropped) where
    the twin scales each element and gets 0 · Inf = NaN."""
    q, kp, vp, table, sl = make_paged([40, 35], 8, 2, D=64, P=16, Sq=1, seed=9)
    kp, vp, ks, vs = _pages("int8", kp, vp)
    scales = ks if where == "k" else vs
    scales[table[0, 1], 5, 1] = bad  # sequence 0, token 21, kv head 1 (query heads 4..7)
    q = q.to(torch.bfloat16)
    args = (table, torch.zeros(2, 1, dtype=torch.long), sl.long().view(-1, 1), 0.125, ks, vs)
    out, _ = paged_decode.decode(q, kp, vp, *args)
    o64, _ = paged_attention_twin(q.double(), kp, vp, *args, compute_dtype=torch.float64)
    hit = o64[0, 4:].isfinite().logical_not()
    assert hit.any()
    assert torch.equal(out[0, 4:].float().isfinite(), o64[0, 4:].isfinite())
    naive, _ = paged_attention_twin(q, kp, vp, *args, compute_dtype=torch.bfloat16)
    assert_close_to_reference(out[1], o64[1], naive[1], dtype=torch.bfloat16)
    assert_close_to_reference(out[0, :4], o64[0, :4], naive[0, :4], dtype=torch.bfloat16)


def test_a_page_dtype_the_kernel_lacks_is_named():
    """Called directly (paged_attention checks first), the kernel names the dtype it lacks and
    the ones it takes, not a KeyError from its dtype table."""
    q, kp, vp, table, lens = make_paged([20], 4, 2, D=16, P=8, Sq=1, seed=3)
    e5m2 = kp.to(torch.float8_e5m2)
    lo, hi = torch.zeros(1, 1, dtype=torch.long), lens.long().view(1, 1)
    with pytest.raises(
        TypeError, match=r"takes k_pages of .*float8_e4m3fn, got torch\.float8_e5m2"
    ):
        paged_decode.decode(q, e5m2, vp, table, lo, hi, 0.25, torch.ones(1), None)


@pytest.mark.parametrize(
    "storage, qdtype",
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.bfloat16)],
    ids=["fp32", "bf16", "int8"],
)
@pytest.mark.parametrize(
    "lens, Hq, Hkv, D, P, Sq, split",
    [
        ([97, 41, 7], 8, 2, 64, 16, 1, False),  # decode rows, pages of 16
        ([53, 30], 6, 3, 37, 8, 3, True),  # odd D, 3 rows, split over keys
        ([61, 25, 40], 4, 4, 40, 32, 2, True),  # MHA, 32-slot pages
    ],
    ids=["gqa4", "gqa2-odd-split", "mha-p32"],
)
def test_per_head_holes_match_the_fp64_oracle(isa, storage, qdtype, lens, Hq, Hkv, D, P, Sq, split):
    """``holes (B, Hkv, 2)``: each kv head's rows skip their own key range (a compacted
    sequence's ragged kept counts): holes mid-page, over whole pages, one head's empty, one
    covering every key of a page for all heads (skipped unread), against the fp64 twin by the
    ratio rule, whole pages (the fused step) and split work items alike."""
    seed = hash((isa, storage, tuple(lens), Hq)) % 2**31
    q, kp, vp, table, sl = make_paged(lens, Hq, Hkv, D=D, P=P, Sq=Sq, seed=seed)
    kp, vp, ks, vs = _pages(storage, kp, vp)
    q = q.to(qdtype)
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    holes = torch.zeros(B, Hkv, 2, dtype=torch.long)
    for b, n in enumerate(lens):
        n_max = max(2, (n - Sq) * 3 // 4)  # the keys before it hold each head's kept counts
        start = torch.randint(1, n_max, (Hkv,), generator=g)
        start[0] = n_max  # an empty hole
        if b == 0:
            start[-1] = 1  # a hole over whole pages
        holes[b, :, 0], holes[b, :, 1] = start, n_max
    if B > 1:  # every head's hole covers a whole page of sequence 1
        holes[1, :, 0] = torch.minimum(holes[1, :, 0], torch.tensor(P // 2))
        holes[1, :, 1] = torch.maximum(holes[1, :, 1], torch.tensor(P * 2))
    pos = sl.long().view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq)
    lo, hi = torch.zeros_like(pos), pos + 1
    args = (table, lo, hi, D**-0.5, ks, vs)
    pages = int(((hi.amax() + P - 1) // P).item())
    splits = ((pages + 1) // 2, 2) if split else None
    out, lse = paged_decode.decode(q, kp, vp, *args, splits=splits, holes=holes)
    o64, l64 = paged_attention_twin(q.double(), kp, vp, *args, holes=holes)
    naive, naive_lse = paged_attention_twin(q, kp, vp, *args, compute_dtype=qdtype, holes=holes)
    assert_close_to_reference(out.to(qdtype), o64, naive.to(qdtype), dtype=qdtype)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")
    # the holes change the answer (the test can fail): without them the rows differ
    plain, _ = paged_decode.decode(q, kp, vp, *args, splits=splits)
    assert not torch.equal(plain, out)


def _finite_parts(actual, oracle, naive):
    """The three score tensors at the slots the oracle attends, after checking that the kernel
    attends (writes) exactly those: every other slot keeps the caller's -inf."""
    attended = torch.isfinite(oracle)
    assert torch.equal(torch.isfinite(actual), attended), "scores written at unattended slots"
    return actual[attended].double(), oracle[attended], naive[attended].double()


@pytest.mark.parametrize(
    "storage, qdtype",
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("int8", torch.bfloat16),
        ("fp8", torch.float32),
    ],
    ids=["fp32", "bf16", "int8", "fp8"],
)
@pytest.mark.parametrize("case", ["p16-odd-window", "p32-general", "sq3-rows-over-groups",
                                  "four-intervals", "holes"])  # fmt: skip
def test_key_scores_match_the_fp64_twin(isa, storage, qdtype, case):
    """The kernel's per-key scores (H2O / TOVA's statistic: weights are exp(score - lse)) on
    every path and page dtype, fused and general pages, split items, windows, 4 disjoint key
    intervals and per-kv-head holes: written exactly at the attended slots, each within the
    ratio rule of the fp64 twin's, the weights too; out and lse unchanged by recording."""
    name = "p16-odd-window" if case == "holes" else case
    lens, Hq, Hkv, D, Dv, P, Sq, window, n_int = _MIXED[name]
    seed = hash((isa, storage, case, "scores")) % 2**31
    q, kp, vp, table, sl = make_paged(lens, Hq, Hkv, D=D, P=P, Sq=Sq, Dv=Dv, seed=seed)
    kp, vp, ks, vs = _pages(storage, kp, vp)
    q = q.to(qdtype)
    pos = sl.long().view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq) absolute positions
    if n_int == 1:
        lo, hi = (pos - window).clamp(min=0), pos + 1
    else:  # disjoint intervals, the last up to the row's own position
        cuts = torch.tensor([0, 3, 11, 20, 29, 45, 52, 70])
        lo = torch.minimum(cuts[0::2].expand(*pos.shape, n_int), pos.unsqueeze(-1) + 1)
        hi = torch.minimum(cuts[1::2].expand(*pos.shape, n_int), pos.unsqueeze(-1) + 1)
        hi[..., -1] = pos + 1
        lo[..., -1] = torch.minimum(lo[..., -1], hi[..., -1])
    holes = None
    if case == "holes":  # kv head 0 skips [40, 60) of sequence 0, head 1 [30, 35) of sequence 2
        holes = torch.zeros(len(lens), Hkv, 2, dtype=torch.long)
        holes[0, 0] = torch.tensor([40, 60])
        holes[2, 1] = torch.tensor([30, 35])
    pages = int(((hi.amax() + P - 1) // P).item())
    args = (table, lo, hi, D**-0.5, ks, vs)
    scores = torch.full((*q.shape[:3], table.shape[1] * P), float("-inf"))
    out, lse = paged_decode.decode(q, kp, vp, *args, splits=((pages + 1) // 2, 2), holes=holes,
                                   scores=scores)  # fmt: skip
    plain, plain_lse = paged_decode.decode(q, kp, vp, *args, splits=((pages + 1) // 2, 2),
                                           holes=holes)  # fmt: skip
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    _, l64, s64 = paged_attention_twin(q.double(), kp, vp, *args, compute_dtype=torch.float64,
                                       holes=holes, return_scores=True)  # fmt: skip
    _, _, naive = paged_attention_twin(q, kp, vp, *args, compute_dtype=qdtype, holes=holes,
                                       return_scores=True)  # fmt: skip
    got, want, low = _finite_parts(scores, s64, naive)
    assert_close_to_reference(got, want, low, dtype=qdtype, what="scores")
    w, w64 = paged_decode.key_weights(scores, lse), torch.exp(s64 - l64.unsqueeze(-1))
    w_naive = torch.exp(naive - torch.logsumexp(naive.float(), -1, keepdim=True))
    assert_close_to_reference(w.double(), w64, w_naive.double(), dtype=qdtype, what="weights")


def test_a_score_buffer_of_the_wrong_shape_is_refused():
    q, kp, vp, table, lens = make_paged([9, 4], 4, 2, D=16, P=4, Sq=1, seed=7)
    lo, hi = torch.zeros_like(lens).long().view(-1, 1), lens.long().view(-1, 1)
    bad = torch.full((2, 4, 1, 5), float("-inf"))
    with pytest.raises(ValueError, match=r"max_pages \* P\)=\(2, 4, 1, "):
        paged_decode.decode(q, kp, vp, table, lo, hi, 0.25, None, None, scores=bad)
