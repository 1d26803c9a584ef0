"""The backend registry serves dense and paged attention alike: names, select, explain.

Numbers are checked per backend elsewhere (test_attention.py, test_paged.py); here: which backend
runs, that explain says so for paged calls too, and that every "no" comes with its reason.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import selfattn as sa
from selfattn import masks, scores
from selfattn.backends import AttentionCall, Cost, registry
from selfattn.backends._auto import rank
from selfattn.backends.chunked import density
from selfattn.cache import paged_attention
from selfattn.call import prepare
from selfattn.kernels import fused_attention, paged_decode
from selfattn.testing import make_qkv
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import check, make_paged, spy_paged_backends

needs_c_kernel = pytest.mark.c_kernel(paged_decode)


def test_dense_triton_is_registered_and_declines_with_its_reason():
    """docs/design.md lists backend="triton": it runs the masks and score mods it can read as
    data and declines the others, saying so, in explain and when asked for by name."""
    assert "triton" in sa.backends.names()
    q, k, v = make_qkv(1, 2, 5, 8, seed=2)
    mask = masks.causal() | masks.padding(2)
    why = sa.backends.explain(q, k, v, mask=mask, print_table=False).reasons["triton"]
    assert "not one key interval per row" in why
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call: mask"):
        sa.attention(q, k, v, mask=mask, backend="triton")


def test_paged_backends_are_their_own_kind():
    assert set(sa.backends.names("paged")) == {"torch", "cpu", "triton"}
    assert all(sa.backends.get(n, "paged").kind == "paged" for n in sa.backends.names("paged"))
    assert "cpu" not in sa.backends.names()  # not offered to attention()
    with pytest.raises(ValueError, match=r"unknown paged backend 'sdpa'.*'cpu'"):
        sa.backends.get("sdpa", kind="paged")
    with pytest.raises(ValueError, match="unknown backend kind 'sparse'"):
        sa.backends.names("sparse")


@needs_c_kernel
def test_explain_paged_names_the_choice_and_every_reason(monkeypatch):
    """explain_paged takes paged_attention's arguments; auto runs what it names."""
    monkeypatch.delenv("SELFATTN_PAGED_TRITON", raising=False)
    args = make_paged([23, 9], 4, 2, D=8, P=4, Sq=1, seed=5)
    ex = sa.backends.explain_paged(*args, mask=masks.causal(), print_table=False)
    assert ex.chosen == "cpu" and "C kernel" in ex.why
    assert set(ex.reasons) == {"torch", "cpu", "triton"} and ex.reasons["torch"] is None
    text = str(ex)
    assert text.splitlines()[0].startswith("auto -> cpu")
    assert all(any(ln.split()[:1] == [n] for ln in text.splitlines()) for n in ("torch", "triton"))
    ran = spy_paged_backends(monkeypatch)
    paged_attention(*args, mask=masks.causal())
    assert ran == ["cpu"]

    ex = sa.backends.explain_paged(*args, score_mod=scores.softcap(5.0), print_table=False)
    assert ex.chosen == "torch" and "score_mod" in ex.reasons["cpu"]
    ex = sa.backends.explain_paged(*make_paged([23, 40], 4, 2, D=8, P=4, Sq=17), print_table=False)
    assert ex.chosen == "torch" and "Sq=17 > 16" in ex.reasons["cpu"]
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    ex = sa.backends.explain_paged(*args, print_table=False)
    assert ex.chosen == "torch" and "SELFATTN_DECODE_KERNEL=0" in ex.reasons["cpu"]


def test_explain_paged_prints_by_default_and_validates_like_paged_attention(capsys):
    args = make_paged([7], 2, 1, D=8, P=4, Sq=1, seed=6)
    ex = sa.backends.explain_paged(*args)
    assert str(ex) in capsys.readouterr().out
    q, kp, vp, table, _ = args  # table (1, 3), P = 4: room for 12 tokens
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=13 exceeds the capacity"):
        sa.backends.explain_paged(q, kp, vp, table, torch.tensor([13]))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_backend_by_name_runs_that_backend(monkeypatch, backend):
    if backend == "cpu":
        c_kernel(paged_decode)
    q, kp, vp, table, lens = make_paged([23, 9, 14], 4, 2, D=8, P=4, Sq=2, seed=7)
    ran = spy_paged_backends(monkeypatch)
    check(q, kp, vp, table, lens, mask=masks.sliding_window(5), backend=backend)
    assert ran == [backend]


def test_paged_backend_by_name_that_cannot_run_says_why():
    q, kp, vp, table, lens = make_paged([23, 9], 4, 2, D=8, P=4, Sq=1, seed=8)
    with pytest.raises(ValueError, match=r"backend 'cpu' cannot run this call: a score_mod.*"):
        paged_attention(q, kp, vp, table, lens, score_mod=scores.softcap(5.0), backend="cpu")
    with pytest.raises(ValueError, match="explain_paged"):
        paged_attention(q.double(), kp.double(), vp.double(), table, lens, backend="cpu")
    with pytest.raises(ValueError, match="unknown paged backend 'sdpa'"):
        paged_attention(q, kp, vp, table, lens, backend="sdpa")


# -- auto: each backend's cost hook ---------------------------------------------------------------
_S = 517  # odd, and long enough for a sliding window to leave most tiles empty
_DOCS = torch.arange(_S) // 40
# Masked CPU work goes to the fused C kernel where it builds, else to chunked.
_FUSED = "cpu_fused" if fused_attention.library() is not None else "chunked"
# No mask and causal calls long enough for its set-up: the fused kernel where its costs were
# measured (the AVX-512 build, cpu_fused.FITS), else sdpa (costed as its equal; ties go to sdpa).
_MEASURED = _FUSED == "cpu_fused" and "avx512f" in fused_attention.isa().split("+")
_FAST = "cpu_fused" if _MEASURED else "sdpa"


@pytest.mark.parametrize(
    "Sq, kwargs, chosen",
    [
        (_S, {}, _FAST),
        (_S, dict(mask=masks.causal()), _FAST),
        (_S, dict(mask=masks.causal(), q_offset=0), _FAST),
        (1, dict(mask=masks.causal()), "sdpa"),
        # decode: 8 of 517 keys, but too small a call for the tile backends' per-call set-up
        (1, dict(mask=masks.sliding_window(8)), "sdpa"),
        (33, dict(mask=masks.causal()), "sdpa"),
        (_S, dict(mask=masks.sliding_window(8)), _FUSED),
        (_S, dict(mask=masks.documents(_DOCS)), _FUSED),
        # two documents: sdpa's dense-mask kernel against chunked, the fused kernel beats both
        (
            _S,
            dict(mask=masks.documents(torch.arange(_S) // 300)),
            _FUSED.replace("chunked", "sdpa"),
        ),
        (_S, dict(mask=lambda b, h, q, kv: (q - kv).abs() < 16), _FUSED),
        # ALiBi: sdpa materialises a float mask (all pairs), the fused kernel skips tiles
        (
            _S,
            dict(score_mod=scores.alibi(2), mask=masks.causal()),
            _FUSED.replace("chunked", "sdpa"),
        ),
        (_S, dict(score_mod=scores.softcap(5.0)), _FUSED),  # the fused kernel caps in-kernel
        (_S, dict(dropout_p=0.1), _FUSED),
        (_S, dict(return_lse=True), _FAST),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_auto_choices_on_cpu(Sq, kwargs, chosen):
    """What auto picks on CPU (the measured rules of backends/_auto.py); unchanged since the
    choice moved into the backends' cost hooks, but for the fused C kernel, which
    takes sparse masks from chunked and, where it measured faster, long no-mask and causal
    calls from sdpa (tests/backends/test_cpu_fused_cost.py has its regimes)."""
    q, k, v = make_qkv(1, 2, Sq, 16, Sk=_S, seed=Sq)
    with torch.no_grad():
        assert sa.backends.explain(q, k, v, print_table=False, **kwargs).chosen == chosen


def _fake(device: str, *shape):
    """What the cost hooks read of a tensor (device, shape): CUDA rules checked on any host."""
    return types.SimpleNamespace(device=torch.device(device), shape=shape, dtype=torch.float32)


@pytest.mark.parametrize(
    "mask, q_offset, score_mod, capable, chosen",
    [
        (masks.sliding_window(8), 0, None, ("sdpa", "chunked", "flex"), "flex"),
        (masks.causal(), 63, None, ("sdpa", "chunked", "flex"), "sdpa"),  # decode
        (masks.causal(), 63, scores.softcap(5.0), ("chunked", "flex"), "flex"),
        (None, 0, None, ("chunked", "flex"), "chunked"),  # e.g. lse, which sdpa lacks on CUDA
        (masks.sliding_window(8), 0, None, ("sdpa", "chunked"), "density"),
    ],
)
def test_auto_choices_on_cuda_follow_the_cost_hooks(mask, q_offset, score_mod, capable, chosen):
    """CUDA's rules from the same hooks: flex for masks, sdpa's flash kernel for dense and
    causal work, flex before chunked for score mods; without flex, the mask's density decides."""
    # The density case is long enough for the tile backends' per-call set-up to vanish.
    S = 4096 if chosen == "density" else 64
    q, k = _fake("cuda", 1, 2, 1 if q_offset else S, 16), _fake("cuda", 1, 2, S, 16)
    call = AttentionCall(mask=mask, score_mod=score_mod, q_offset=q_offset)
    names = [n for n in sa.backends.names() if n in (*capable, "reference")]  # registry order
    costs = {n: sa.backends.get(n).cost(q, k, None, call) for n in names}
    if chosen != "density":
        assert rank(costs, density=pytest.fail)[0] == chosen  # density never needed here
        return
    assert rank(costs, density=lambda: 0.49)[0] == "chunked"
    assert rank(costs, density=lambda: 0.5)[0] == "sdpa"


def test_auto_ranks_by_cost_hooks_and_asks_density_only_when_it_decides(monkeypatch):
    """A backend whose hook says it is cheapest is picked, whatever its name; a sparse cost is
    weighed against the mask's density only when the best sparse backend is not cheaper
    outright (the estimate reads the mask's tiles)."""
    reference = sa.backends.get("reference")
    dense = registry()._backends
    # the fused kernel's measured costs would compete with the test backends: the rules are
    # checked among sdpa, chunked and them
    monkeypatch.delitem(dense, "cpu_fused")
    q, k, v = make_qkv(1, 2, _S, 16, seed=4)

    def add(name, per_pair, sparse=False):
        hook = lambda *args: Cost(per_pair, f"test backend at {per_pair}", sparse)  # noqa: E731
        monkeypatch.setitem(dense, name, dataclasses.replace(reference, name=name, cost=hook))

    estimates = []
    real_density = registry()._density
    monkeypatch.setattr(registry(), "_density", lambda *a: estimates.append(1) or real_density(*a))

    add("mine", 0.5)  # dense, cheaper than sdpa's causal work (1 × density) unless tiles skip
    ex = sa.backends.explain(q, k, v, mask=masks.causal(), print_table=False)
    d = density(q, k, prepare(q, k, v, mask=masks.causal())[3])
    assert 0.5 < d < 0.6  # a causal square: about half its tiles are empty
    assert estimates == [1] and ex.why == f"test backend at 0.5 (mask density {d:.2f})"
    assert ex.chosen == "mine" and ex.notes["sdpa"].endswith(f"costs {d:.3g} per pair vs 0.5")
    ran = []
    monkeypatch.setitem(dense, "mine", dataclasses.replace(dense["mine"], run=_spy(ran)))
    sa.attention(q, k, v, mask=masks.causal())
    assert ran == ["mine"] and len(estimates) == 2

    add("mine", 0.6)  # now dearer than sdpa's causal tiles
    assert sa.backends.explain(q, k, v, mask=masks.causal(), print_table=False).chosen == "sdpa"
    assert len(estimates) == 3
    add("tiles", 0.1, sparse=True)  # sparse and cheaper than every dense cost: no estimate
    ex = sa.backends.explain(q, k, v, mask=masks.causal(), print_table=False)
    assert ex.chosen == "tiles" and len(estimates) == 3
    assert ex.notes["mine"].endswith("costs 0.6 per pair vs 0.1 × density")


def test_a_decode_sized_masked_call_is_ranked_without_reading_the_mask(monkeypatch):
    """The tile backends' per-call set-up (``Cost.fixed``) outweighs what skipping tiles saves
    on a decode step, so auto sends it to sdpa without estimating the density; a long call with
    the same mask goes to a tile backend (reading the mask only where its density decides)."""
    estimates = []
    real_density = registry()._density
    monkeypatch.setattr(registry(), "_density", lambda *a: estimates.append(1) or real_density(*a))
    window = masks.sliding_window(96)
    q, _, _ = make_qkv(1, 4, 1, 32, seed=11)
    _, k, v = make_qkv(1, 4, 97, 32, seed=12)
    ex = sa.backends.explain(q, k, v, mask=window, print_table=False)
    assert ex.chosen == "sdpa" and ex.density is None and estimates == []
    assert "× density + " in ex.notes["chunked"]
    q, k, v = make_qkv(1, 4, 2048, 32, seed=13)
    ex = sa.backends.explain(q, k, v, mask=window, print_table=False)
    # where the fused kernel's measured per pair is below sdpa's dense mask, it is cheapest at
    # any density and the mask is not read; otherwise the density decides
    unread = _MEASURED
    assert ex.chosen == _FUSED and (ex.density is None) == unread
    assert estimates == ([] if unread else [1])


def _spy(ran):
    def run(q, k, v, call):
        ran.append("mine")
        return sa.backends.get("reference").run(q, k, v, call)

    return run


@dataclasses.dataclass(frozen=True)
class _CallWithNewField(AttentionCall):
    """AttentionCall plus a field no built-in backend knows (as sinks were, once)."""

    novel: torch.Tensor | None = None


def test_a_call_field_a_backend_does_not_declare_makes_it_decline(monkeypatch):
    """Opt-in support: a backend runs only the call fields it lists in ``supports``; a call that
    sets another one is declined with a reason naming the field, by auto, select and explain
    alike. Left at its default, the field asks nothing and changes nothing."""
    q, k, v = make_qkv(1, 2, 7, 8, seed=9)
    plain = sa.backends.available(q, k, v, _CallWithNewField())
    assert plain == sa.backends.available(q, k, v, AttentionCall())
    call = _CallWithNewField(novel=torch.zeros(2))
    reasons = sa.backends.available(q, k, v, call)
    assert all("the call sets novel" in why for why in reasons.values()), reasons
    with pytest.raises(ValueError, match=r"no dense backend can run this call: .*sets novel"):
        sa.backends.select(q, k, v, call)
    with pytest.raises(
        ValueError, match="backend 'sdpa' cannot run this call: the call sets novel"
    ):
        sa.backends.select(q, k, v, call, backend="sdpa")

    reference = sa.backends.get("reference")
    knows = dataclasses.replace(reference, supports=reference.supports | {"novel"})
    monkeypatch.setitem(registry()._backends, "reference", knows)
    backend, ex = sa.backends.select(q, k, v, call)
    assert backend is knows and ex.chosen == "reference" and ex.reasons["reference"] is None
    assert "sets novel" in ex.reasons["chunked"]  # explain says why the others did not run it


def test_paged_backends_decline_unknown_fields_too(monkeypatch):
    """The paged registry follows the same rule over PagedCall's fields."""
    from selfattn.backends.paged.call import PagedCall, prepare

    @dataclasses.dataclass(frozen=True, eq=False)
    class PagedCallWithNewField(PagedCall):
        novel: torch.Tensor | None = None

    args = make_paged([9, 4], 4, 2, D=8, P=4, Sq=1, seed=11)
    base = prepare(*args)
    call = PagedCallWithNewField(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    )
    assert registry("paged").available(*args, call) == registry("paged").available(*args, base)
    call = dataclasses.replace(call, novel=torch.zeros(4))
    reasons = registry("paged").available(*args, call)
    assert set(reasons) == {"torch", "cpu", "triton"}
    assert all("the call sets novel" in why for why in reasons.values()), reasons
