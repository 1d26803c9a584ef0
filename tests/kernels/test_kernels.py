"""selfattn.kernels: sources as files, custom ops with fakes, torch.compile through them, layering.

The kernels' numbers are checked elsewhere (test_paged.py, test_triton_paged.py against the fp64
oracle, test_robust_paged.py under hostile inputs); here: what makes them PyTorch operators.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import selfattn as sa
from selfattn.cache import paged_attention
from selfattn.cache.quant import quantize_int8
from selfattn.kernels import ops, paged_decode
from selfattn.kernels.paged_twin import paged_attention_twin
from selfattn.testing import assert_close_to_reference
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import make_paged

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src" / "selfattn" / "kernels"

needs_c_kernel = pytest.mark.c_kernel(paged_decode)


def _interpreted_triton() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")


def _kernel_args(Sq=2, quantised=False, dtype=torch.float32, seed=1):
    """Arguments of a paged-decode op: causal intervals over two ragged sequences."""
    q, kp, vp, table, lens = make_paged([37, 20], 4, 2, D=16, P=8, Sq=Sq, dtype=dtype, seed=seed)
    pos = lens.long().view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq) absolute positions
    lo, hi = torch.zeros_like(pos), pos + 1
    ks = vs = None
    if quantised:
        (kp, ks), (vp, vs) = quantize_int8(kp), quantize_int8(vp)
    return q, kp, vp, table, lo, hi, 16**-0.5, ks, vs


# -- sources and build spec ---------------------------------------------------------------------


def _c_enum(source: str, first: str) -> list[str]:
    """The names of the C enum whose first member is ``first``, without their prefix."""
    body = re.search(r"enum\s*\{([^}]*\b" + first + r"\b[^}]*)\}", source).group(1)
    names = [n.strip() for n in body.split(",") if n.strip()]
    prefix = first.split("_")[0] + "_"
    return [n.removeprefix(prefix) for n in names if not n.endswith("NARGS") and n != "P_NPTRS"]


def test_kernel_arguments_follow_the_c_enums():
    """The host fills the kernel's argument arrays by name, in the order of the C source's enums:
    a member added to one side only would shift every later argument."""
    source = (KERNELS / "csrc" / "paged_decode.c").read_text()
    assert _c_enum(source, "A_B") == list(paged_decode.INT_ARGS)
    assert _c_enum(source, "P_Q") == list(paged_decode.PTR_ARGS)


def test_c_sources_ship_in_the_wheel():
    """Every file a build spec compiles is a package file that pyproject's package-data ships."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    patterns = package_data["selfattn.kernels"]
    for path in paged_decode.SPEC.source_paths():
        assert path.is_file(), path
        rel = path.relative_to(KERNELS).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)


def test_kernels_import_nothing_above_them():
    """docs/design.md's layers: kernels import torch, the standard library and Triton, and from
    selfattn only kernels (lazy imports inside functions included)."""
    offenders = []
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                if name.startswith(".") or (
                    name.startswith("selfattn") and not name.startswith("selfattn.kernels")
                ):
                    offenders.append(f"{path.relative_to(KERNELS)}: {name}")
    assert list(KERNELS.rglob("*.py")) and not offenders, offenders


# -- custom ops ---------------------------------------------------------------------------------


@needs_c_kernel
@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
def test_cpu_op_matches_its_twin(quantised, dtype):
    """The C kernel against its plain-PyTorch twin in float64 (ratio rule, the twin in the input
    dtype as the noise baseline); the op writes out in q's dtype, lse in float32."""
    args = _kernel_args(Sq=3, quantised=quantised, seed=9)
    q = args[0].to(dtype)
    out, lse = ops.paged_decode_cpu(q, *args[1:])
    assert out.dtype == dtype and lse.dtype == torch.float32
    o64, l64 = paged_attention_twin(q.double(), *args[1:])  # float64 in, float64 out
    naive, naive_lse = paged_attention_twin(q, *args[1:], compute_dtype=dtype)
    assert_close_to_reference(out, o64, naive, dtype=dtype)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")


@needs_c_kernel
@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "int8"])
def test_cpu_op_passes_opcheck(quantised):
    """Schema, fake, autograd registration and AOT dispatch of selfattn::paged_decode_cpu."""
    torch.library.opcheck(ops.paged_decode_cpu, _kernel_args(quantised=quantised))


def test_triton_op_passes_opcheck():
    _interpreted_triton()
    torch.library.opcheck(ops.paged_decode_triton, _kernel_args())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fakes_state_output_dtype_and_device(dtype):
    """Both ops return out in q's dtype and lse in float32. Under FakeTensorMode nothing runs,
    so no compiler or Triton is needed."""
    args = _kernel_args(dtype=dtype)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out_c, lse_c = ops.paged_decode_cpu(*fake)
        out_t, lse_t = ops.paged_decode_triton(*fake)
    B, Hq, Sq = args[0].shape[:3]
    for out, lse in ((out_c, lse_c), (out_t, lse_t)):
        assert out.shape == (B, Hq, Sq, args[2].shape[3]) and out.dtype == dtype
        assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
        assert out.device == lse.device == torch.device("cpu")


# -- torch.compile ------------------------------------------------------------------------------


def _decode_step(q, k_pages, v_pages, block_table, seq_lens):
    return paged_attention(q, k_pages, v_pages, block_table, seq_lens, return_lse=True)


@pytest.fixture(scope="module")
def compiled_step():
    c_kernel(paged_decode)
    torch._dynamo.reset()
    yield torch.compile(_decode_step, fullgraph=True)
    torch._dynamo.reset()


@needs_c_kernel
def test_paged_decode_step_compiles_without_graph_breaks(compiled_step):
    """A decode step (B=2, Sq=1, fp32, CPU) traces whole: validation, backend selection and the
    C kernel's op (through its fake); compiled output == eager output, bit for bit."""
    args = make_paged([37, 20], 4, 2, D=16, P=8, Sq=1, seed=3)
    assert sa.backends.explain_paged(*args, print_table=False).chosen == "cpu"
    explained = torch._dynamo.explain(_decode_step)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    ops_in_graph = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "selfattn.paged_decode_cpu.default" in ops_in_graph
    for got, want in zip(compiled_step(*args), _decode_step(*args)):
        assert torch.equal(got, want)


@needs_c_kernel
@pytest.mark.parametrize("bad", ["page id", "length"])
def test_compiled_step_still_refuses_bad_tables(compiled_step, bad):
    """In a compiled graph the value checks are asserts, so a page id outside the pool or a
    length past the table never reaches the kernel (it would read memory outside the pool)."""
    q, kp, vp, table, lens = make_paged([37, 20], 4, 2, D=16, P=8, Sq=1, seed=4)
    compiled_step(q, kp, vp, table, lens)  # compiled for these shapes
    if bad == "page id":
        table[1, 1] = kp.shape[0] + 5
    else:
        lens[0] = table.shape[1] * kp.shape[1] + 1
    with pytest.raises(RuntimeError, match="block_table" if bad == "page id" else "seq_lens"):
        compiled_step(q, kp, vp, table, lens)


def test_paged_decode_step_compiles_through_the_triton_op(monkeypatch):
    """The same decode step sent to the Triton kernel (interpreted on CPU): one graph around
    selfattn::paged_decode_triton, equal to eager."""
    _interpreted_triton()
    monkeypatch.setenv("SELFATTN_PAGED_TRITON", "1")
    args = make_paged([37, 20], 4, 2, D=16, P=8, Sq=1, seed=5)
    assert sa.backends.explain_paged(*args, print_table=False).chosen == "triton"

    def triton_step(*a):  # its own code object: compiled caches are per function
        return paged_attention(*a, return_lse=True)

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(triton_step)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons
        ops_in_graph = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
        assert "selfattn.paged_decode_triton.default" in ops_in_graph
        compiled = torch.compile(triton_step, fullgraph=True)
        for got, want in zip(compiled(*args), triton_step(*args)):
            assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()
