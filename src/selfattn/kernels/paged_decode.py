"""The C paged-decode kernel (``csrc/paged_decode.c``): attention over a paged KV cache on CPU,
reading each page in place, exactly once.

Why C: a decode step is memory-bound (one query row per head against the whole cache), and
every plain-PyTorch formulation of it over a randomly permuted page pool either copies the
pages first (a gather that reads and writes the cache before the matmuls read it again) or
runs one tiny ``(G, D) @ (D, P)`` matmul per page and kv head, whose per-matrix overhead costs
more than reading the page (page-batched ``bmm`` over strided in-place views takes most of
SDPA's whole time for the scores alone, and again for the weighted V sum). The kernel walks
each sequence's pages in table order and, per page, reads its
``(P, Hkv, D)`` block front to back twice (K, then V): scores for every query row, an online
softmax update, then the weighted V rows, asking for the next page's rows meanwhile (software
prefetch: the pages of a sequence lie anywhere in the pool). Low-precision and quantised pages
are converted in registers inside the dot-product and weighted-sum blocks (int8 and fp8 scales
multiply the scores and the V weights); bf16 queries against bf16 or int8 keys use
``vdpbf16ps`` where the CPU has it, and against bf16 values too (weights rounded to bf16, as
SDPA's bf16 kernels round the probabilities). A page every query row attends whole (every
decode page) takes one fused step per kv head: softmax update as vectors over its slots, then
the V sum with the rescale folded in; other pages (a window's first page, pages over 16 slots)
the general path. fp8 pages on a CPU with avx512_vbmi are converted by byte tables (``vpermt2b``:
64 codes an instruction). The next page's rows are prefetched into L2 as a page is computed.
One source, instruction-set paths picked at run time (:data:`ISAS`, :func:`isa`;
``SELFATTN_DECODE_ISA`` forces a lower one). Why it is built this
way (memory latency, not arithmetic, bounds a decode step): the header of
``csrc/paged_decode.c``. torch.compile of a gather-and-reduce decode is no alternative: seconds
to compile on first call, then slower than SDPA on contiguous K/V.

Build: :data:`SPEC`, through :mod:`selfattn.kernels.build` (first use, seconds; cached per
user and CPU, never loaded from a cache another user could write). Called
through :mod:`ctypes`, which releases the GIL during the call. Threads (``csrc/thread_pool.h``:
PyTorch's OpenMP threads where the build shares its libgomp, else the kernel's own worker pool)
pulling ``(sequence, key split)`` work items, as many as ``torch.get_num_threads()`` and the
pages read pay for (:mod:`~selfattn.kernels.threads`: a short context runs on the calling
thread). No compiler, a failed build or ``SELFATTN_DECODE_KERNEL=0``: :func:`library` returns None.

The op ``torch.ops.selfattn.paged_decode_cpu`` (:mod:`selfattn.kernels.ops`) wraps
:func:`decode`; its plain-PyTorch twin is :func:`selfattn.kernels.paged_twin.paged_attention_twin`.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from selfattn.kernels import threads
from selfattn.kernels.build import CLibrary, Function, load
from selfattn.kernels.determinism import is_deterministic, split_pages
from selfattn.kernels.markers import assume_constant_result

__all__ = [
    "ENV_VAR", "ISAS", "SPEC", "Launch", "decode", "isa", "key_splits", "key_weights", "library",
    "supported_dtypes",
]  # fmt: skip

ENV_VAR = "SELFATTN_DECODE_KERNEL"  # 0 turns the kernel off
SPEC = CLibrary(
    name="paged_decode",
    sources=("paged_decode.c",),
    functions=(
        # paged_decode(iargs, ptrs, n_threads, scale) -> 0, or 1 when scratch memory ran out
        Function(
            "paged_decode",
            (
                ctypes.POINTER(ctypes.c_int64),
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_int,
                ctypes.c_float,
            ),
        ),
        Function("has_f16", (), ctypes.c_int),  # 1 when the compiler has _Float16
        # paged_decode_isa(want) -> the instruction-set code a call with A_ISA = want runs
        Function("paged_decode_isa", (ctypes.c_int,), ctypes.c_int),
        *threads.POOL_FUNCTIONS,
    ),
    # gnu11, not c11: ISO mode turns off FMA contraction (-ffp-contract=off), halving the FLOP
    # rate.
    flags=("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-ffp-contract=fast"),
    # Vector code for this CPU's features (the library name hashes them); portable code where
    # the compiler or CPU rejects -march=native.
    targets=(("-march=native",), ()),
    libraries=("m",),
    openmp=True,
)
# Page dtype -> kernel code (the enum at the top of csrc/paged_decode.c).
_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
    torch.float8_e4m3fn: 4,
}
# The kernel's arguments in the order of its enums (``A_*``, ``P_*`` in csrc/paged_decode.c; a
# test reads them from the source): the integers, then the data pointers.
INT_ARGS = (
    "B", "HQ", "HKV", "SQ", "D", "DV", "P", "MAXP", "NSPLIT", "SPLIT_PAGES",
    "KSN", "KSP", "KSH", "VSN", "VSP", "VSH", "KDT", "VDT", "KSC", "VSC", "QDT", "ISA", "NI", "ODT",
)  # fmt: skip
PTR_ARGS = (
    "Q", "K", "V", "KSCALE", "VSCALE", "LUT", "TABLE", "LO", "HI", "OUT", "LSE", "SINKS", "HOLES",
    "SCORES",
)  # fmt: skip
# The kernel's instruction-set paths (the ISA_* enum of csrc/paged_decode.c), lowest first: one
# C source compiled for each; the kernel runs the best this CPU has unless SELFATTN_DECODE_ISA
# names a lower one (tests force "generic", the path every machine runs).
ISAS = ("generic", "avx2", "avx512", "avx512_bf16", "avx512_vbmi")
# Work items per thread the key splits aim for, so that ragged lengths still balance.
ITEMS_PER_THREAD = 4


@functools.cache
def _library_once() -> ctypes.CDLL | None:
    return load(SPEC)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (then use PyTorch)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    return _library_once()


@assume_constant_result  # torch.compile: asked once while tracing, not traced
def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The page (and query) dtypes the kernel reads; none where it cannot be built or is off
    (fp16 needs the compiler's ``_Float16``)."""
    lib = library()
    return () if lib is None else _dtypes_of(lib)


@functools.cache
def _dtypes_of(lib: ctypes.CDLL) -> tuple[torch.dtype, ...]:
    return tuple(d for d in _DTYPE_CODES if d != torch.float16 or lib.has_f16())


@functools.cache
def _fp8_table() -> torch.Tensor:
    """float8_e4m3fn byte -> float32, taken from PyTorch's own conversion (NaN codes included)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def key_splits(lo: torch.Tensor, hi: torch.Tensor, P: int) -> tuple[int, int]:
    """``(n_split, split_pages)``: each sequence's pages are cut into ``n_split`` work items of
    ``split_pages`` pages, enough items for ``ITEMS_PER_THREAD`` per thread (flash-decoding's
    split over the keys, for a small batch). In deterministic mode
    (:mod:`~selfattn.kernels.determinism`) ``split_pages`` is fixed by the page size alone, so
    a row's splits (from its sequence's first attended page) and their merge order depend on
    its own keys only, not on the batch or the threads; the longest sequence sets the count,
    and a shorter one's trailing splits are empty (a partial of no key merges exactly)."""
    B = lo.shape[0]
    lo, hi = lo.reshape(B, -1), hi.reshape(B, -1)  # (B, Sq) or (B, Sq, NI): every interval
    pages = (hi.amax(dim=1) + P - 1) // P - lo.amin(dim=1) // P  # (B,) logical pages to walk
    span = int(pages.clamp(min=0).max()) if B else 0
    if is_deterministic():
        per = split_pages(P)
        return max(1, -(-span // per)), per
    n_split = max(1, min(span, -(-ITEMS_PER_THREAD * torch.get_num_threads() // max(B, 1))))
    per = max(1, -(-span // n_split))
    return max(1, -(-span // per)), per


def decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    splits: tuple[int, int] | None = None,
    holes: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over pages: ``out (B, Hq, Sq, Dv)`` in q's dtype (summed in float32),
    ``lse (B, Hq, Sq)`` float32.

    ``q (B, Hq, Sq, D)`` fp32/bf16/fp16 (scaled by ``scale`` inside); pages ``(N, P, Hkv, D|Dv)``
    with unit stride on the last dim, of a dtype in :func:`supported_dtypes`; ``table
    (B, max_pages)`` integer page ids, those of the pages holding keys ``[lo, hi)`` in
    ``[0, N)``; ``lo, hi (B, Sq)`` integer: query row ``i`` of sequence ``b`` attends keys
    ``lo[b, i] <= t < hi[b, i]`` (``hi <= max_pages * P``); or ``lo, hi (B, Sq, NI)``: row ``i``
    attends the union of ``NI`` disjoint intervals (StreamingLLM: the sinks and the window),
    each page that no row attends skipped unread. Scales: int8 ``(N, P, Hkv)``
    bfloat16, fp8 ``(Hkv,)`` float32, or None for float pages. A row with no allowed key gets
    ``out = 0``, ``lse = -inf``. ``sinks (Hq,)``: learned attention-sink logits joining each
    row's softmax denominator once, where the splits merge (a row with no key then gets ``lse =
    sink``). ``holes (B, Hkv, 2)`` integer: the rows of sequence ``b``, kv head ``h`` also
    skip keys ``holes[b, h, 0] <= t < holes[b, h, 1]`` (a compacted sequence's ragged kept
    counts, :meth:`~selfattn.cache.PagedKV.compact`; a page touching a hole takes the general
    path, one inside every head's hole is skipped unread); the values there must be finite
    (compaction zeroes them). CPU tensors only; index tensors, scales and sinks are made
    contiguous here. ``scores (B, Hq, Sq, max_pages * P)`` float32, contiguous (filled by the
    caller, e.g. with -inf): each attended key's score is written at its slot, in the units of
    ``lse`` (``scale * q . k``, times int8/fp8 key scales), so that a row's attention weights
    are ``exp(scores - lse)`` (:func:`key_weights`); slots a row does not attend keep the
    caller's value. None costs nothing.

    Sequences are split over their keys into ``n_split`` work items when there are fewer than
    ``ITEMS_PER_THREAD`` per thread; the kernel merges the splits' softmax partials in float32.
    ``splits``: :func:`key_splits` of these ``lo, hi`` when the caller has them already (a
    planned step computes them once for every layer).
    """
    lib, args, out, lse, _ = _arguments(
        q, k_pages, v_pages, table, lo, hi, k_scales, v_scales, sinks, splits, holes
    )
    args[1][_SCORES] = _scores_ptr(scores, q, table, v_pages)
    return _launch(lib, *args, scale, out, lse)


def key_weights(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The attention weights ``(..., L)`` of a call's rows from the ``scores (..., L)`` the
    kernel wrote and its ``lse (...)``: ``exp(scores - lse)``, 0 at unattended (-inf) slots."""
    return torch.exp(scores - lse.unsqueeze(-1))


def _scores_ptr(scores, q, table, v_pages) -> int:
    """The address of a score buffer (0 for None), checked against the call's shapes."""
    if scores is None:
        return 0
    want = (*q.shape[:3], table.shape[1] * v_pages.shape[1])
    if (
        not isinstance(scores, torch.Tensor)
        or tuple(scores.shape) != want
        or scores.dtype != torch.float32
        or not scores.is_contiguous()
        or scores.device.type != "cpu"
    ):
        got = (tuple(scores.shape), scores.dtype) if isinstance(scores, torch.Tensor) else scores
        raise ValueError(
            f"scores must be a contiguous float32 CPU tensor (B, Hq, Sq, max_pages * P)={want}, "
            f"got {got}"
        )
    return scores.data_ptr()


def _dtype_code(name: str, t: torch.Tensor) -> int:
    """``t``'s kernel dtype code; TypeError naming the dtypes the kernel takes (paged_attention
    checks a call's dtypes before it reaches the kernel; this is for direct calls)."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(
            f"the C decode kernel takes {name} of {', '.join(map(str, _DTYPE_CODES))}, got "
            f"{t.dtype}"
        )
    return code


def _arguments(q, k_pages, v_pages, table, lo, hi, k_scales, v_scales, sinks, splits, holes=None):
    """``(lib, (int args, pointer args), out, lse, tensors)`` of one :func:`decode` call, the
    arguments as ctypes arrays; ``tensors``: the (converted) ones the pointers point into."""
    lib = library()
    if lib is None:
        raise RuntimeError(
            "the C decode kernel is not available (no C compiler, a failed build, or "
            "SELFATTN_DECODE_KERNEL=0); use paged_attention, which falls back to PyTorch"
        )
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("the C decode kernel needs pages with a contiguous last dim")
    q = q.contiguous()
    # Dtype tests: a planned step passes them ready, and a no-op ``to`` still costs ~2 µs a call
    table = (table if table.dtype == torch.int32 else table.to(torch.int32)).contiguous()
    lo = (lo if lo.dtype == torch.int64 else lo.to(torch.int64)).contiguous()
    hi = (hi if hi.dtype == torch.int64 else hi.to(torch.int64)).contiguous()
    n_intervals = 1 if lo.dim() == 2 else lo.shape[2]
    k_scales, v_scales = (None if s is None else s.contiguous() for s in (k_scales, v_scales))
    sinks = _sinks_f32(sinks)
    B, Hq, Sq, D = q.shape
    P, Hkv, Dv = v_pages.shape[1:]
    n_split, split_pages = key_splits(lo, hi, P) if splits is None else splits
    # The kernel writes out in q's dtype (float32, bfloat16 or float16; see merge in the C
    # source for why it converts), lse in float32, whatever torch's default dtype is.
    out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype, device="cpu")
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device="cpu")
    ks, vs = k_pages.stride(), v_pages.stride()
    ints = {
        "B": B, "HQ": Hq, "HKV": Hkv, "SQ": Sq, "D": D, "DV": Dv, "P": P,
        "MAXP": table.shape[1], "NSPLIT": n_split, "SPLIT_PAGES": split_pages,
        "KSN": ks[0], "KSP": ks[1], "KSH": ks[2], "VSN": vs[0], "VSP": vs[1], "VSH": vs[2],
        "KDT": _dtype_code("k_pages", k_pages), "VDT": _dtype_code("v_pages", v_pages),
        "KSC": _scales_code(k_scales), "VSC": _scales_code(v_scales),
        "QDT": _dtype_code("q", q), "ISA": _requested_isa(), "NI": n_intervals,
        "ODT": _DTYPE_CODES[q.dtype],
    }  # fmt: skip
    tensors = {
        "Q": q, "K": k_pages, "V": v_pages, "KSCALE": k_scales, "VSCALE": v_scales,
        "LUT": _fp8_table(), "TABLE": table, "LO": lo, "HI": hi, "OUT": out, "LSE": lse,
        "SINKS": sinks, "HOLES": _holes_i64(holes), "SCORES": None,
    }  # fmt: skip
    iargs = [ints[name] for name in INT_ARGS]
    ptrs = [0 if (t := tensors[name]) is None else t.data_ptr() for name in PTR_ARGS]
    # the K/V bytes the walk may read: every sequence's longest span of slots (an upper bound)
    slot_bytes = Hkv * (D * k_pages.element_size() + Dv * v_pages.element_size())
    n_threads = threads.for_bytes(
        B * n_split * split_pages * P * slot_bytes, openmp_threads=threads.openmp(lib)
    )
    args = ((ctypes.c_int64 * len(iargs))(*iargs), (ctypes.c_void_p * len(ptrs))(*ptrs), n_threads)
    return lib, args, out, lse, tensors


def _sinks_f32(sinks):
    """The sinks as the kernel reads them: float32, contiguous, outside autograd (or None)."""
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def _holes_i64(holes):
    """The holes as the kernel reads them: int64, contiguous (or None)."""
    if holes is None:
        return None
    return (holes if holes.dtype == torch.int64 else holes.to(torch.int64)).contiguous()


def _launch(lib, iargs, ptrs, n_threads, scale, out, lse):
    status = lib.paged_decode(iargs, ptrs, n_threads, ctypes.c_float(scale))
    if status:
        raise MemoryError("paged_attention: the decode kernel could not allocate its scratch")
    return out, lse


_Q, _K, _V, _OUT, _LSE, _SINKS, _HOLES, _SCORES = (
    PTR_ARGS.index(n) for n in ("Q", "K", "V", "OUT", "LSE", "SINKS", "HOLES", "SCORES")
)


class Launch:
    """:func:`decode` for the layers of a planned step: the arguments of one layout (q's shape
    and dtype, the pages' layout, the table, the intervals and splits; float pages) built once,
    then per call only the pointers of q, the layer's pages, the sinks and the outputs are set
    (~4 µs of Python a call instead of ~11). Same results as :func:`decode`."""

    def __init__(self, q, k_pages, v_pages, table, lo, hi, splits):
        self._lib, (self._iargs, self._ptrs, self._threads), out, lse, self._tensors = _arguments(
            q, k_pages, v_pages, table, lo, hi, None, None, None, splits
        )
        self._shapes = (out.shape, lse.shape)
        self._scratch = lse  # the lse of calls that do not want it: written, never read
        self._layout = self._layout_of(q, k_pages, v_pages)

    def native(self) -> tuple:
        """What C code needs to run this launch itself: ``(entry, iargs, ptrs, n_threads,
        slots, lse)``: the address of ``paged_decode``, the ctypes arrays of its int and pointer
        arguments (the pointers of this launch's table and intervals set, held by it), its
        thread count, the indices in ``ptrs`` of ``"Q"``, ``"K"``, ``"V"``, ``"OUT"``, ``"LSE"``
        and ``"SINKS"``, and an lse scratch tensor. The caller sets those pointers (q
        contiguous in the launch's shape, out of its shape in q's dtype) before each call."""
        self._ptrs[_SCORES] = 0  # the caller's calls record no scores
        entry = ctypes.cast(self._lib.paged_decode, ctypes.c_void_p).value
        slots = {"Q": _Q, "K": _K, "V": _V, "OUT": _OUT, "LSE": _LSE, "SINKS": _SINKS}
        return entry, self._iargs, self._ptrs, self._threads, slots, self._scratch

    @staticmethod
    def _layout_of(q, k_pages, v_pages) -> tuple:
        return (q.shape, q.dtype, k_pages.shape, k_pages.dtype, k_pages.stride(), v_pages.shape,
                v_pages.dtype, v_pages.stride())  # fmt: skip

    def fits(self, q, k_pages, v_pages) -> bool:
        """Whether a call with these tensors has this launch's layout."""
        return self._layout_of(q, k_pages, v_pages) == self._layout

    def __call__(self, q, k_pages, v_pages, scale: float, sinks=None, return_lse: bool = True,
                 holes=None, scores=None):  # fmt: skip
        """``(out, lse)`` of :func:`decode` for tensors that :meth:`fits` this launch; ``lse``
        None unless ``return_lse`` (the kernel then writes it to a scratch tensor); ``holes``
        and ``scores`` as :func:`decode`'s (per layer: they differ between a step's layers)."""
        q = q.contiguous()
        out = torch.empty(self._shapes[0], dtype=q.dtype, device="cpu")
        lse = (
            torch.empty(self._shapes[1], dtype=torch.float32, device="cpu")
            if return_lse
            else self._scratch
        )
        sinks = _sinks_f32(sinks)
        ptrs = self._ptrs
        ptrs[_Q], ptrs[_K], ptrs[_V] = q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr()
        ptrs[_OUT], ptrs[_LSE] = out.data_ptr(), lse.data_ptr()
        ptrs[_SINKS] = 0 if sinks is None else sinks.data_ptr()
        holes = _holes_i64(holes)
        ptrs[_HOLES] = 0 if holes is None else holes.data_ptr()
        ptrs[_SCORES] = _scores_ptr(scores, q, self._tensors["TABLE"], v_pages)
        out, lse = _launch(self._lib, self._iargs, ptrs, self._threads, scale, out, lse)
        return out, (lse if return_lse else None)


def _requested_isa() -> int:
    """The ``SELFATTN_DECODE_ISA`` path as the kernel's code; -1 (the best) when unset."""
    name = os.environ.get("SELFATTN_DECODE_ISA", "")
    if not name:
        return -1
    if name not in ISAS:
        raise ValueError(f"SELFATTN_DECODE_ISA={name!r}: expected one of {', '.join(ISAS)}")
    return ISAS.index(name)


def isa() -> str | None:
    """The instruction-set path a call runs now (``SELFATTN_DECODE_ISA`` applied: a path above
    the CPU's best gives its best); None without the kernel."""
    lib = library()
    return None if lib is None else ISAS[lib.paged_decode_isa(_requested_isa())]


def _scales_code(scales: torch.Tensor | None) -> int:
    """0: float pages; 1: int8 scales per token and head ``(N, P, Hkv)`` bfloat16; 2: fp8 per
    head, float32."""
    return 0 if scales is None else (1 if scales.dim() == 3 else 2)
