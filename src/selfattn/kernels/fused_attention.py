"""The fused CPU attention kernel (``csrc/fused_attention.c``): forward and backward over a mask's
tile classification, in one pass over the tiles, with no per-tile dispatch.

Why C: the ``chunked`` backend runs FlashAttention's algorithm with PyTorch ops, one batched
matmul and several elementwise passes per chunk of tiles; on a CPU each op costs a dispatch and a
trip of the score tile through memory, and sdpa's fused kernel skips tiles for no mask but
causal. Here each work item (sequence, head, query tile) keeps its query rows, running max, sum
and output accumulator in L1 and walks its non-empty key tiles: scores by one register-blocked
micro-kernel (``mm``: 4 rows x 64 keys of accumulators in AVX-512 registers), the PARTIAL tiles'
mask applied from a byte block, the online-softmax update with a vectorised ``exp2``, then the
weighted V rows by the same micro-kernel. FULL tiles do no mask work; EMPTY tiles are never
visited; within a PARTIAL tile each block of 4 rows computes only the keys one of its rows
attends. In the kernel too: ALiBi (absolute positions), an additive bias tensor (broadcast
strides; its gradient is dS summed over the broadcast axes by the backward's dQ pass), the soft
cap ``cap·tanh(s / cap)`` last (a vectorised tanh within 2.8 ulp of float32; the backward
chains through ``1 - tanh²``), and attention dropout with the counter-based pattern of
``backends/_common.dropout_keep`` (same kept pairs as every backend).
bf16 q, k, v on a build with ``avx512_bf16`` run the forward's two products with ``vdpbf16ps``
(K and V packed once as bf16 pair words): scores as exact bf16 products summed in float32, then
times the scale; P·V with the weights rounded to bf16 (the row sums stay float32): the output
is within the ratio rule of bf16 arithmetic, the dtype it is returned in, and the lse of float32.
The forward takes each block of 4 rows through scores, mask, softmax and P·V in one pass (its
scores stay in L1; row sums kept as vectors), masks the rows of PARTIAL tiles that are key
intervals (windows, causal diagonals, document edges: found once per call) by comparing key
indices instead of reading their bytes, and keeps the packed K/V buffer from call to call on
2 MiB pages (fresh pages cost a fifth of the time). The backward stays float32.
A call without dropout (and, in float32, without score mods) runs on transposed score tiles
(``fwd_t``, AVX-512 builds; the others keep ``fwd_item``): ``Sᵀ = K Qᵀ`` puts 16 query rows in
a vector, so the online softmax's row max, sum, running max and rescale factor are vertical
vector operations (per row they are latency-bound chains of horizontal reductions, a scalar
``exp2f`` and branches); PARTIAL tiles are 64-bit row masks per key, used as AVX-512 lane masks
(any mask, intervals or not); the weights' ``2^x`` is a degree-5 polynomial with ``vscalefps``
(float32-exact: the lse keeps float32 accuracy); the rescale is folded into P·V's accumulator
load; Qᵀ is packed by 16x16 register transposes; full key tiles read K in place (float32,
even-D bf16). bf16 score mods run on the transposed tile (``apply_mods_t``, a -inf score masked
before the ``2^x``); float32 mods gain nothing there and stay on ``fwd_item``, as does dropout.
The float32 micro-kernel keeps its B rows in registers (gcc folds each load into the FMAs
reading it: load-bound otherwise). BENCHMARKS.md has the kernel's times against its peers.
The backward recomputes the weights from the saved row max and sum: dQ by query tile, then dK/dV
by key tile (over the query tiles and the G heads of a kv head), or all three in one pass per
(sequence, kv head); no atomics. Δ is rowsum(dO ∘ O), but rowsum(P ∘ dP) / rowsum(P) from the
kernel's own P and dP on query tiles with a row of weight over 1/2 on one key (their scores and
dP kept for the tile: no product twice), where rowsum(dO ∘ O)'s rounding swamped dS.

The tile description (:class:`Tiles`, built by the backend from ``Mask.tile_kinds``): the query
tiles' non-EMPTY key tiles as CSR lists (and their transpose for the backward), and one byte
block per PARTIAL tile (per mask batch and head where the mask varies) from the mask's own
``mask_mod``: general (every mask, user callables included) and ``O(partial tiles · tile²)``
memory: for a sliding window of 256 at S=16384, 512 blocks of 4 KiB.

Build: :data:`SPEC`, through :mod:`selfattn.kernels.build`, with ``-march=native`` (the library
name hashes the CPU's flags, so AVX-512 code never loads on an AVX2 machine) and portable code
where that fails; :data:`GENERIC_SPEC` is the same source built for the baseline ISA, what a CPU
without the vector features gets, and :data:`AVX2_SPEC` the AVX2 + FMA build (what an AVX2-only
CPU gets from ``-march=native``). ``SELFATTN_FUSED_ISA=avx2|generic`` forces a
lower build (``native``, the default: the best); ``SELFATTN_ATTN_KERNEL=generic`` and
``generic=True`` force the generic one, ``SELFATTN_ATTN_KERNEL=0`` turns the kernel off. A forced
``avx2`` on a CPU without AVX2 and FMA runs the generic build (logged once). :func:`isa` names
what the build that runs uses.
q, k, v are read in their dtype (float32, bf16, fp16) and converted as tiles are packed (a
whole-tensor ``.float()`` first takes as long as the kernel itself on long inputs);
accumulation is float32, and so are the
outputs but the forward's ``out``, which the kernel writes in q's dtype (a float32 ``out`` for
bf16 inputs was twice the fresh pages and a copy after the call).
Threads (``csrc/thread_pool.h``: PyTorch's OpenMP threads where the build shares its libgomp,
else the kernel's own worker pool) pulling work items, as many as ``torch.get_num_threads()``
and the work pays for (:mod:`~selfattn.kernels.threads`: a small call runs on the calling
thread); each item writes only its own rows, so the result is bitwise the same for any thread
count.

The ops ``torch.ops.selfattn.attention_fwd_cpu`` / ``attention_bwd_cpu`` (:mod:`selfattn.
kernels.ops`) wrap :func:`forward` / :func:`backward`; the plain-PyTorch twin of both is
:func:`twin`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os

import torch

from selfattn.kernels import threads
from selfattn.kernels.build import CLibrary, Function, load

__all__ = [
    "AVX2_SPEC",
    "BLOCK_K",
    "ENV_VAR",
    "GENERIC_SPEC",
    "ISAS",
    "SPEC",
    "Tiles",
    "backward",
    "base2",
    "exp2_weights",
    "forward",
    "isa",
    "library",
    "log2_sums",
    "requested_isa",
    "spec",
    "tanh",
    "twin",
]

ENV_VAR = "SELFATTN_ATTN_KERNEL"
ISA_VAR = "SELFATTN_FUSED_ISA"
# The builds SELFATTN_FUSED_ISA chooses from, lowest first; "native" is -march=native.
ISAS = ("generic", "avx2", "native")
LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x · LOG2E)
BLOCK_K = 64  # keys per tile: the kernel's BK (fa_block_k() checks it)
MAX_BLOCK_Q = 64  # query rows per tile at most: the kernel's MAXBQ

_ARGS = (ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
SPEC = CLibrary(
    name="fused_attention",
    sources=("fused_attention.c",),
    functions=(
        # fa_forward(iargs, ptrs, n_threads, c) -> 0, 1 (no scratch memory), 2 (bad tile size)
        Function("fa_forward", (*_ARGS, ctypes.c_float)),
        Function("fa_backward", (*_ARGS, ctypes.c_float, ctypes.c_float)),
        Function("fa_isa", (), ctypes.c_int),
        Function("fa_block_k", (), ctypes.c_int),
        Function("fa_has_f16", (), ctypes.c_int),  # 1 when the compiler has _Float16
        # fa_tanh(x, y, n): the soft cap's vectorised tanh, for tests
        Function("fa_tanh", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
        # fa_exp2w(x, y, n): the forward's 2^x for the weights, for tests
        Function("fa_exp2w", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
        # fa_log2(x, y, n): the forward's log2 of the row sums (its lse), for tests
        Function("fa_log2", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
        *threads.POOL_FUNCTIONS,
    ),
    # gnu11, not c11: ISO mode turns off FMA contraction (-ffp-contract=off), halving the FLOP
    # rate.
    flags=("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-ffp-contract=fast"),
    targets=(("-march=native",), ()),
    libraries=("m",),
    openmp=True,
)
# The same source for the baseline ISA of the compiler's target (x86-64: SSE2): the code a CPU
# without AVX gets, and the forced path tests compare the vector build with.
GENERIC_SPEC = dataclasses.replace(SPEC, name="fused_attention_generic", targets=((),))
# AVX2 + FMA without AVX-512 (x86-64 only): the code an AVX2-only CPU runs, forced on
# a larger CPU to test it there.
AVX2_SPEC = dataclasses.replace(
    SPEC, name="fused_attention_avx2", targets=(("-mavx2", "-mfma", "-mf16c"),)
)
_SPECS = {"generic": GENERIC_SPEC, "avx2": AVX2_SPEC, "native": SPEC}
log = logging.getLogger("selfattn")

# The kernel's arguments in the order of its enums (``A_*``, ``P_*`` in csrc/fused_attention.c;
# a test reads them from the source).
INT_ARGS = (
    "B", "HQ", "HKV", "SQ", "SK", "D", "DV", "BQ", "BK", "NQ", "NK", "MB", "MH", "DT", "QOFF",
    "SEED", "BIAS_SB", "BIAS_SH", "BIAS_SQ", "BIAS_SK", "SLOPES_SB",
)  # fmt: skip
PTR_ARGS = (
    "Q", "K", "V", "ROWPTR", "COLS", "PIDS", "COLPTR", "ROWS", "CPIDS", "BITS", "OUT", "LSE",
    "M", "L", "DO", "DLSE", "DELTA", "DQ", "DK", "DV", "SLOPES", "DROP", "BIAS", "CAP", "DBIAS",
    "FINITE",
)  # fmt: skip
_ISA_BITS = ((4, "avx512f"), (8, "avx512_bf16"), (1, "avx2"), (2, "fma"))
# q, k, v dtype -> kernel code (the enum at the top of csrc/fused_attention.c)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _load(build: str) -> ctypes.CDLL | None:
    if build == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning(  # AVX2 code would stop the process with SIGILL here
            "selfattn: %s=avx2 on a CPU without AVX2 and FMA; the generic build runs", ISA_VAR
        )
        build = "generic"
    lib = load(_SPECS[build])
    if lib is not None and lib.fa_block_k() != BLOCK_K:
        return None  # a source edited out of step with this module
    return lib


def requested_isa() -> str:
    """The build ``SELFATTN_FUSED_ISA`` asks for (one of :data:`ISAS`; ``native`` when unset,
    ``generic`` under ``SELFATTN_ATTN_KERNEL=generic``)."""
    name = os.environ.get(ISA_VAR, "")
    if not name:
        return "generic" if os.environ.get(ENV_VAR, "1") == "generic" else "native"
    if name not in ISAS:
        raise ValueError(f"{ISA_VAR}={name!r}: expected one of {', '.join(ISAS)}")
    return name


def spec(generic: bool = False) -> CLibrary:
    """The build spec :func:`library` loads (the baseline-ISA one with ``generic``)."""
    return _SPECS["generic" if generic else requested_isa()]


def forced_generic() -> bool:
    """Whether ``SELFATTN_FUSED_ISA=generic`` or ``SELFATTN_ATTN_KERNEL=generic`` forces the
    baseline-ISA build."""
    return requested_isa() == "generic"


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The compiled kernel: the build :func:`requested_isa` names (the baseline-ISA one with
    ``generic``), built on first use; None where it cannot be built or with
    ``SELFATTN_ATTN_KERNEL=0``."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    return _load("generic" if generic else requested_isa())


def isa(generic: bool = False) -> str:
    """The vector instruction sets the kernel that runs was compiled for, e.g.
    ``"avx512f+avx512_bf16+avx2+fma"``; ``"generic"`` for baseline code; ``"none"`` when there
    is no kernel."""
    lib = library(generic)
    if lib is None:
        return "none"
    bits = lib.fa_isa()
    names = [name for bit, name in _ISA_BITS if bits & bit]
    return "+".join(names) if names else "generic"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Which tiles of the ``(Sq, Sk)`` score matrix a call visits, and the PARTIAL ones' masks.

    Query tile ``i`` covers rows ``[i·block_q, (i+1)·block_q)``, key tile ``j`` keys
    ``[j·BLOCK_K, (j+1)·BLOCK_K)`` (the last of each ragged). ``rowptr (n_q + 1,)``, ``cols``,
    ``pids`` int32: query tile ``i``'s non-EMPTY key tiles are ``cols[rowptr[i]:rowptr[i+1]]``
    (ascending), each with ``pids`` its PARTIAL block's index or -1 (FULL: no mask work).
    ``colptr (n_k + 1,)``, ``rows``, ``cpids``: the same by key tile (the backward's dK/dV
    walk). ``bits (n_partial, mask_b, mask_h, block_q, BLOCK_K)`` uint8, 1 where the pair
    attends (rows and keys past ``Sq``/``Sk`` unread); ``mask_b`` is 1 or B, ``mask_h`` 1 or Hq.
    """

    block_q: int
    rowptr: torch.Tensor
    cols: torch.Tensor
    pids: torch.Tensor
    colptr: torch.Tensor
    rows: torch.Tensor
    cpids: torch.Tensor
    bits: torch.Tensor
    mask_b: int = 1
    mask_h: int = 1

    @staticmethod
    def from_grid(nonempty: torch.Tensor, full: torch.Tensor, block_q: int, bits, mask_b, mask_h):
        """From bool ``nonempty, full (n_q, n_k)`` (over every batch and head) and the PARTIAL
        tiles' blocks in row-major tile order."""
        partial = nonempty & ~full
        pid_grid = torch.full(nonempty.shape, -1, dtype=torch.int32)
        pid_grid[partial] = torch.arange(int(partial.sum()), dtype=torch.int32)

        def csr(ne, pid):  # (n, m) -> ptr (n + 1,), column indices, pids; row-major
            idx = ne.nonzero()
            counts = torch.bincount(idx[:, 0], minlength=ne.shape[0])
            ptr = torch.zeros(ne.shape[0] + 1, dtype=torch.int32)
            torch.cumsum(counts, 0, out=ptr[1:])
            return ptr, idx[:, 1].to(torch.int32).contiguous(), pid[ne].contiguous()

        rowptr, cols, pids = csr(nonempty, pid_grid)
        colptr, rows, cpids = csr(nonempty.t(), pid_grid.t())
        return Tiles(block_q, rowptr, cols, pids, colptr, rows, cpids, bits, mask_b, mask_h)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rowptr, self.cols, self.pids, self.colptr, self.rows, self.cpids, self.bits)


def _call(lib_fn, ints: dict, tensors: dict, *scalars, flops: float) -> None:
    """Run ``lib_fn`` on as many threads as ``flops`` pay for (:mod:`~selfattn.kernels.threads`)."""
    iargs = [ints[name] for name in INT_ARGS]
    ptrs = [0 if (t := tensors.get(name)) is None else t.data_ptr() for name in PTR_ARGS]
    status = lib_fn(
        (ctypes.c_int64 * len(iargs))(*iargs),
        (ctypes.c_void_p * len(ptrs))(*ptrs),
        threads.for_flops(flops),
        *(ctypes.c_float(s) for s in scalars),
    )
    if status == 1:
        raise MemoryError("the fused attention kernel could not allocate its scratch")
    if status:
        raise ValueError(f"the fused attention kernel refused its tile sizes (status {status})")


def _pairs(q: torch.Tensor, tiles: Tiles) -> int:
    """The (query, key) pairs the call computes: every visited tile of every (batch, head)."""
    return q.shape[0] * q.shape[1] * tiles.cols.numel() * tiles.block_q * BLOCK_K


def supported_dtypes(generic: bool = False) -> tuple[torch.dtype, ...]:
    """The q, k, v dtypes the kernel reads (fp16 needs the compiler's ``_Float16``); none where
    there is no kernel."""
    lib = library(generic)
    if lib is None:
        return ()
    return tuple(d for d in _DTYPE_CODES if d != torch.float16 or lib.fa_has_f16())


def _ints(q, k, v, tiles: Tiles, q_offset: int, seed0: int, mods: dict) -> dict:
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bias = mods.get("BIAS")
    strides = (
        [0] * 4
        if bias is None
        else [0 if n == 1 else st for n, st in zip(bias.shape, bias.stride())]
    )
    slopes = mods.get("SLOPES")
    return {
        "BIAS_SB": strides[0], "BIAS_SH": strides[1], "BIAS_SQ": strides[2], "BIAS_SK": strides[3],
        "SLOPES_SB": Hq if slopes is not None and slopes.dim() == 2 else 0,
        "B": B, "HQ": Hq, "HKV": Hkv, "SQ": Sq, "SK": Sk, "D": D, "DV": Dv,
        "BQ": tiles.block_q, "BK": BLOCK_K, "NQ": tiles.rowptr.numel() - 1,
        "NK": tiles.colptr.numel() - 1, "MB": tiles.mask_b, "MH": tiles.mask_h,
        "DT": _DTYPE_CODES[q.dtype], "QOFF": q_offset, "SEED": seed0,
    }  # fmt: skip


def _lib(generic: bool) -> ctypes.CDLL:
    lib = library(generic)
    if lib is None:
        raise RuntimeError(
            "the fused attention kernel is not available (no C compiler, a failed build, or "
            f"{ENV_VAR}=0); use attention(), which falls back to the chunked backend"
        )
    return lib


def _check(tiles: Tiles, qkv, *others: torch.Tensor, generic: bool) -> None:
    if not 1 <= tiles.block_q <= MAX_BLOCK_Q:
        raise ValueError(f"block_q={tiles.block_q} must be in [1, {MAX_BLOCK_Q}]")
    dtypes = supported_dtypes(generic)
    for t in (*qkv, *others):
        want = qkv[0].dtype if any(t is x for x in qkv) else torch.float32
        if t.dtype != want or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"the fused attention kernel takes contiguous CPU tensors, q, k, v of one dtype "
                f"and the rest float32; got {t.dtype} {tuple(t.shape)} on {t.device} "
                f"(contiguous={t.is_contiguous()})"
            )
    if qkv[0].dtype not in dtypes:
        raise ValueError(f"this build of the kernel reads {dtypes}, not {qkv[0].dtype}")


def _slopes(alibi: torch.Tensor | None, B: int, Hq: int) -> dict:
    """ALiBi slopes ``(Hq,)``, or ``(B, Hq)`` one row per sequence, as the kernel takes them:
    float32, times log2(e) (base-2 scores)."""
    if alibi is None:
        return {}
    if tuple(alibi.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(
            f"alibi slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = ({B}, {Hq}), got "
            f"{tuple(alibi.shape)}"
        )
    return {"SLOPES": (alibi.detach().to(torch.float32) * LOG2E).contiguous()}


def _mods(q, k, alibi, bias, softcap: float) -> dict:
    """The score mods as the kernel takes them, in base-2 units (scores are kept in base 2):
    ALiBi slopes ``(Hq,)`` and the bias (copied, float32, broadcast axes kept at size 1) times
    log2(e), the soft cap as ``{cap·log2(e), 1 / (cap·log2(e)), 1 if it comes before ALiBi}``
    (``cap·tanh(s / cap)`` of the natural score is the same function of the base-2 one with the
    cap in base-2 units)."""
    B, Hq, Sq, _ = q.shape
    mods = _slopes(alibi, B, Hq)
    if bias is not None:
        want = (B, Hq, Sq, k.shape[2])
        if bias.dim() != 4 or any(n not in (1, w) for n, w in zip(bias.shape, want)):
            raise ValueError(
                f"bias must broadcast to (B, Hq, Sq, Sk) = {want} with sizes 1 or full, got "
                f"{tuple(bias.shape)}"
            )
        mods["BIAS"] = base2(bias.detach(), torch.float32).contiguous()
    if softcap:
        if not math.isfinite(softcap):
            raise ValueError(
                f"softcap must be a finite number (0: none; negative: the cap before ALiBi), got "
                f"{softcap}"
            )
        cap2 = abs(softcap) * LOG2E
        mods["CAP"] = torch.tensor([cap2, 1.0 / cap2, float(softcap < 0)], dtype=torch.float32)
    return mods


def base2(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x · log2(e)`` in ``dtype``, finite where ``x`` is: a finite score or bias beyond
    ``±max / log2(e)`` (transformers' additive masks hold ``finfo(float32).min``) would overflow
    to ``∓inf`` and make a row whose every key carries it empty (output 0) instead of the softmax
    of equal scores that the oracle and sdpa give; it is held at ``±finfo(dtype).max`` instead.
    ``-inf`` (a masked score) stays ``-inf``. One extra pass where nothing is infinite. The
    product is taken in the wider of the two dtypes: a half-precision bias times log2(e) in half
    precision rounded each base-2 bias to 11 bits (a bias-only lse off by 2^-13 of itself) and
    overflowed past 65504 / log2(e) (a finite bias then held at float32's max)."""
    x2 = (x.to(torch.promote_types(x.dtype, dtype)) * LOG2E).to(dtype)
    if x2.is_cuda or bool(x2.isinf().any()):  # CUDA: no host sync, always the exact form
        overflowed = x2.isinf() & x.isfinite()
        x2 = torch.where(overflowed, x2.sign() * torch.finfo(dtype).max, x2)
    return x2


def _dropout(p: float) -> dict:
    """``{p, 1 / (1 - p)}`` float32 for the kernel's dropout; nothing without dropout."""
    if p == 0:
        return {}
    if not 0 < p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return {"DROP": torch.tensor([p, 1.0 / (1.0 - p)], dtype=torch.float32)}


def forward(q, k, v, tiles: Tiles, scale: float, generic: bool = False, q_offset: int = 0,
            alibi: torch.Tensor | None = None, dropout_p: float = 0.0, seed0: int = 0,
            bias: torch.Tensor | None = None, softcap: float = 0.0,
            finite: torch.Tensor | None = None):  # fmt: skip
    """``(out (B, Hq, Sq, Dv) in q's dtype, lse, m, l (B, Hq, Sq) float32)``.

    ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` contiguous CPU tensors
    of one dtype in :func:`supported_dtypes`, ``Hq`` a multiple of ``Hkv``. ``lse`` natural
    log, ``-inf`` (and ``out`` 0) for a row with no key; ``m`` (base-2 row max of
    ``q·k·scale``) and ``l`` (``Σ 2^(s - m)``) are what :func:`backward` recomputes the
    weights from: ``(0, 1)`` for a row with no key. ``alibi (Hq,)`` or ``(B, Hq)``: ALiBi
    slopes (one row per sequence in the second form), adding ``-slope[b, h]·|i - j|`` to the
    score of query position ``q_offset + row`` and key ``j``.
    ``dropout_p``: attention dropout on the weights (``lse`` stays undropped), keeping the pairs
    of ``_common.dropout_keep``; ``seed0`` is its seed hashed alone (the first step of it).
    ``bias``: an additive score term of shape ``(B|1, Hq|1, Sq|1, Sk|1)`` (row ``i`` = query row
    ``i``; no gradient); ``softcap``: ``cap·tanh(s / cap)`` of the score after ALiBi and the
    bias (0: none); negative, ``|softcap|`` after the bias and before ALiBi (flash-attn's
    order). ``finite``: a bool tensor of one element, set to whether every element of ``q`` and
    of ``out`` (as returned, in q's dtype) is finite: the kernel tests q's rows as it packs them
    and out's as it stores them, so the caller needs no pass over either to trust the result
    (``backends/exact.fused_or_exact``).
    """
    _check(tiles, (q, k, v), generic=generic)
    if finite is not None:
        if finite.dtype != torch.bool or finite.numel() != 1 or finite.device.type != "cpu":
            raise ValueError(
                f"finite must be a CPU bool tensor of one element, got {finite.dtype} "
                f"{tuple(finite.shape)} on {finite.device}"
            )
        finite.fill_(True)  # the kernel writes False only
    B, Hq, Sq, _ = q.shape
    out = torch.empty(B, Hq, Sq, v.shape[3], dtype=q.dtype)  # rounded once, in the kernel
    lse, m, l = (torch.empty(B, Hq, Sq, dtype=torch.float32) for _ in range(3))
    names = ("Q", "K", "V", "OUT", "LSE", "M", "L", "FINITE")
    tensors = dict(zip(names, (q, k, v, out, lse, m, l, finite)))
    tensors.update(_tile_ptrs(tiles))
    tensors.update(mods := _mods(q, k, alibi, bias, softcap))
    tensors.update(_dropout(dropout_p))
    ints = _ints(q, k, v, tiles, q_offset, seed0, mods)
    flops = 2 * _pairs(q, tiles) * (q.shape[3] + v.shape[3])  # Q Kᵀ and P V
    _call(_lib(generic).fa_forward, ints, tensors, scale * LOG2E, flops=flops)
    return out, lse, m, l


def backward(dout, dlse, q, k, v, out, m, l, tiles: Tiles, scale: float, generic: bool = False,
             q_offset: int = 0, alibi: torch.Tensor | None = None, dropout_p: float = 0.0,
             seed0: int = 0, bias: torch.Tensor | None = None, softcap: float = 0.0,
             bias_grad: bool = False):  # fmt: skip
    """``(dq, dk, dv, dbias)`` float32 from ``dout (B, Hq, Sq, Dv)``, the lse's gradient ``dlse
    (B, Hq, Sq)`` (None: 0) and the forward's ``out, m, l`` (all float32); q, k, v as
    :func:`forward`. ``dbias``: with ``bias_grad``, the gradient of ``bias`` (its shape: the
    score gradient summed over the axes it broadcasts, in a fixed order), else None."""
    extra = () if dlse is None else (dlse,)
    _check(tiles, (q, k, v), dout, out, m, l, *extra, generic=generic)
    if bias_grad and bias is None:
        raise ValueError("bias_grad=True needs the bias tensor")
    dq = torch.empty(q.shape, dtype=torch.float32)
    dk = torch.empty(k.shape, dtype=torch.float32)
    dv = torch.empty(v.shape, dtype=torch.float32)
    delta = torch.empty(m.shape, dtype=torch.float32)  # the kernel's scratch
    # float64 sums where the bias broadcasts over query rows or keys (a small tensor, summing
    # many terms; the kernel's dbias_wide), float32 else
    wide = bias is not None and (bias.shape[2] == 1 or bias.shape[3] == 1)
    dtype = torch.float64 if wide else torch.float32
    dbias = torch.zeros(bias.shape, dtype=dtype) if bias_grad else None
    names = ("Q", "K", "V", "OUT", "M", "L", "DO", "DLSE", "DELTA", "DQ", "DK", "DV", "DBIAS")
    tensors = dict(zip(names, (q, k, v, out, m, l, dout, dlse, delta, dq, dk, dv, dbias)))
    tensors.update(_tile_ptrs(tiles))
    tensors.update(mods := _mods(q, k, alibi, bias, softcap))
    tensors.update(_dropout(dropout_p))
    ints = _ints(q, k, v, tiles, q_offset, seed0, mods)
    flops = 2 * _pairs(q, tiles) * (3 * q.shape[3] + 2 * v.shape[3])  # Q Kᵀ, dO Vᵀ, dV, dQ, dK
    _call(_lib(generic).fa_backward, ints, tensors, scale * LOG2E, scale, flops=flops)
    return dq, dk, dv, (None if dbias is None else dbias.to(torch.float32))


def _tile_ptrs(tiles: Tiles) -> dict:
    names = ("ROWPTR", "COLS", "PIDS", "COLPTR", "ROWS", "CPIDS", "BITS")
    for name, t in zip(names, tiles.tensors()):
        want = torch.uint8 if name == "BITS" else torch.int32
        if t.dtype != want or not t.is_contiguous():
            raise ValueError(f"Tiles.{name.lower()} must be contiguous {want}, got {t.dtype}")
    return dict(zip(names, tiles.tensors()))


def _map(name: str, x: torch.Tensor, generic: bool) -> torch.Tensor:
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty_like(x)
    getattr(_lib(generic), name)(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def tanh(x: torch.Tensor, generic: bool = False) -> torch.Tensor:
    """``tanh`` of float32 ``x`` as the kernel's soft cap computes it (for tests)."""
    return _map("fa_tanh", x, generic)


def exp2_weights(x: torch.Tensor, generic: bool = False) -> torch.Tensor:
    """``2^x`` of float32 ``x`` as the forward computes its weights (for tests): the degree-5
    ``exp2w`` of the bf16 path where the build has avx512_bf16, the float32 path's else."""
    return _map("fa_exp2w", x, generic)


def log2_sums(x: torch.Tensor, generic: bool = False) -> torch.Tensor:
    """``log2`` of float32 ``x`` as the forward computes its lse from the row sums (for tests)."""
    return _map("fa_log2", x, generic)


def twin(q, k, v, tiles: Tiles, scale: float, dtype: torch.dtype = torch.float64,
         bias: torch.Tensor | None = None, softcap: float = 0.0):  # fmt: skip
    """The kernel's forward in plain PyTorch, computed in ``dtype``: the tile description
    expanded into a dense ``(B, Hq, Sq, Sk)`` mask, then softmax attention, with ``bias`` added
    to the scores and then ``softcap`` applied as :func:`forward` does. ``(out, lse)``;
    differentiable; for tests."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    bq, n_q = tiles.block_q, tiles.rowptr.numel() - 1
    allowed = torch.zeros(B, Hq, Sq, Sk, dtype=torch.bool)
    for i in range(n_q):
        r0, r1 = i * bq, min((i + 1) * bq, Sq)
        for t in range(int(tiles.rowptr[i]), int(tiles.rowptr[i + 1])):
            c0 = int(tiles.cols[t]) * BLOCK_K
            c1, pid = min(c0 + BLOCK_K, Sk), int(tiles.pids[t])
            if pid < 0:
                allowed[:, :, r0:r1, c0:c1] = True
            else:
                block = tiles.bits[pid, :, :, : r1 - r0, : c1 - c0].bool()  # (Bm, Hm, tq, tk)
                allowed[:, :, r0:r1, c0:c1] = block
    G = Hq // Hkv
    kr = k.to(dtype).repeat_interleave(G, 1)
    vr = v.to(dtype).repeat_interleave(G, 1)
    s = q.to(dtype) @ kr.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.to(dtype)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)  # -inf for a row with no key
    p = torch.exp(s - lse.unsqueeze(-1).clamp(min=torch.finfo(dtype).min))
    return p @ vr, lse
