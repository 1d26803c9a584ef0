"""The decode fast path of CausalLM (selfattn.models.decode_fast) and the blocks' lean step
(selfattn.nn.blocks.RowsStep): a planned paged step's blocks, uniform or packed (the serving
engine's), run without module calls, bit for bit the logits of the module path with float
projections (quantised ones run fused kernel calls: as close to the fp64 reference), float or
quantised pages, and only where nothing (hooks, inspection, autograd, a swapped module) could
tell the difference."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn

from selfattn.cache import PagedKV
from selfattn.kernels import quant_matmul as qmm
from selfattn.models import decode_fast
from selfattn.models.decoder import Llama
from selfattn.nn import QuantizedLinear, SwiGLU
from selfattn.positions import RoPE
from selfattn.testing import assert_close_to_reference

VOCAB = 97
_WINDOWED = ["sliding_attention", "full_attention", "sliding_attention"]


def _llama(seed: int, **extra) -> Llama:
    torch.manual_seed(seed)
    cfg = {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 76,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
        "max_position_embeddings": 256, **extra,
    }  # fmt: skip
    model = Llama.from_config(cfg).eval()
    with torch.no_grad():  # norms off their init (ones), so that a skipped weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _decode(model, prompts, tokens, *, steps=(1, 1, 2, 1), attention_mask=None):
    """Logits of a paged prefill (one row per prompt: ragged lengths when they differ) and decode
    steps of ``steps`` tokens each, concatenated flat."""
    B = len(prompts)
    cache = model.make_cache("paged", B, 64, page_size=4)
    out = []
    with torch.no_grad():
        for b, p in enumerate(prompts):  # rows of different lengths: a ragged batch
            row = cache.cache.view([cache.seq_ids[b]])
            out.append(model(p[None], cache=row, attention_mask=attention_mask).flatten())
        t = 0
        for S in steps:
            out.append(model(tokens[:, t : t + S], cache=cache).flatten())
            t += S
    return torch.cat(out)


def _hooked(model):
    """A no-op forward hook on a block's module: the model takes its module path."""
    return model.layers[1].mlp.register_forward_hook(lambda *args: None)


def _case(seed: int, B: int, ragged: bool):
    g = torch.Generator().manual_seed(seed)
    lens = [11 + 3 * b if ragged else 11 for b in range(B)]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    return prompts, torch.randint(0, VOCAB, (B, 5), generator=g)


@pytest.mark.parametrize(
    "B, ragged, extra",
    [
        (1, False, {}),
        (3, True, {}),  # (B, S) positions
        (2, False, {"layer_types": _WINDOWED, "sliding_window": 6, "model_type": "qwen2"}),
        (2, True, {"attention_bias": True, "model_type": "qwen2"}),
    ],
)
def test_fast_path_logits_bitwise_equal_module_path(B, ragged, extra):
    model = _llama(B + 10 * len(extra), **extra)
    prompts, tokens = _case(B, B, ragged)
    fast = _decode(model, prompts, tokens)
    handle = _hooked(model)
    try:
        slow = _decode(model, prompts, tokens)
    finally:
        handle.remove()
    assert torch.equal(fast, slow)


def test_fast_path_bf16_bitwise_equal_module_path():
    model = _llama(3).to(torch.bfloat16)
    prompts, tokens = _case(3, 2, True)
    fast = _decode(model, prompts, tokens)
    with _module_path():
        slow = _decode(model, prompts, tokens)
    assert torch.equal(fast, slow)


class _module_path:
    """A global forward hook: every model takes its module path."""

    def __enter__(self):
        self.handle = nn.modules.module.register_module_forward_hook(lambda *args: None)

    def __exit__(self, *exc):
        self.handle.remove()


def test_fast_path_calls_no_module_forward(monkeypatch):
    model = _llama(4)
    prompts, tokens = _case(4, 2, False)
    calls = []
    original = SwiGLU.forward

    def counted(self, x):
        calls.append(1)
        return original(self, x)

    monkeypatch.setattr(SwiGLU, "forward", counted)
    cache = model.make_cache("paged", 2, 64, page_size=4)
    with torch.no_grad():
        model(torch.stack(prompts), cache=cache)  # a prefill: planned too
        n = len(calls)
        model(tokens[:, :1], cache=cache)
    assert len(calls) == n  # the decode step called no SwiGLU
    with torch.enable_grad():  # autograd: the module path
        model(tokens[:, 1:2], cache=cache)
    assert len(calls) == n + len(model.layers)


def test_rope_factors_once_per_step_under_inference_mode(monkeypatch):
    """The server decodes under inference_mode, whose tensors have no version counter: the
    shared RoPE must still compute the step's factors once, not once per layer, and the logits
    must be those of no_grad."""
    model = _llama(5)
    prompts, tokens = _case(5, 2, True)
    calls = []
    original = RoPE.cos_sin

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    logits = []
    for mode in (torch.no_grad, torch.inference_mode):
        cache = model.make_cache("paged", 2, 64, page_size=4)
        with mode():
            for b, p in enumerate(prompts):
                model(p[None], cache=cache.cache.view([cache.seq_ids[b]]))
            monkeypatch.setattr(RoPE, "cos_sin", counted)
            calls.clear()
            logits.append(model(tokens[:, :1], cache=cache))
            monkeypatch.setattr(RoPE, "cos_sin", original)
        assert len(calls) == 1, (mode.__name__, len(calls), len(model.layers))
    assert torch.equal(*logits)


def test_hooks_fire_and_inspection_is_honoured():
    model = _llama(5)
    prompts, tokens = _case(5, 2, False)
    seen = []
    handle = model.layers[2].self_attention.register_forward_hook(lambda *a: seen.append(1))
    try:
        _decode(model, prompts, tokens)
    finally:
        handle.remove()
    assert len(seen) == 2 + 4  # two prefills, four decode steps
    # A head mask (selfattn.inspect.mask_heads sets it) reaches the output on the fast path too.
    plain = _decode(model, prompts, tokens)
    model.layers[0].self_attention.head_mask = torch.tensor([1.0, 0, 1, 1, 0, 1])
    masked = _decode(model, prompts, tokens)
    with _module_path():
        masked_slow = _decode(model, prompts, tokens)
    assert not torch.equal(plain, masked) and torch.equal(masked, masked_slow)


def test_swapped_module_is_used():
    model = _llama(6)
    prompts, tokens = _case(6, 1, False)
    _decode(model, prompts, tokens)  # the fast path has seen the tree
    torch.manual_seed(1)
    model.layers[1].mlp = SwiGLU(48, 50)  # another module (and width)
    fast = _decode(model, prompts, tokens)
    with _module_path():
        slow = _decode(model, prompts, tokens)
    assert torch.equal(fast, slow)
    model.layers[0].mlp.activation = torch.tanh  # an attribute, not a module
    fast = _decode(model, prompts, tokens)
    with _module_path():
        slow = _decode(model, prompts, tokens)
    assert torch.equal(fast, slow)
    model.layers[1].mlp = nn.Sequential(nn.Linear(48, 48), nn.Tanh())  # not a SwiGLU at all
    fast = _decode(model, prompts, tokens)
    with _module_path():
        slow = _decode(model, prompts, tokens)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize(
    "kw", [{}, {"interleaved": True}, {"rotary_dim": 6}], ids=["half", "interleaved", "partial"]
)
@pytest.mark.parametrize("ragged", [False, True])
def test_rope_rotate_tokens_first_is_forward_transposed(kw, ragged):
    g = torch.Generator().manual_seed(7)
    rope = RoPE(10, **kw)
    B, S, H = 3, 5, 4
    x = torch.randn(B, S, H, 10, generator=g)
    pos = torch.randint(0, 40, (B, S) if ragged else (S,), generator=g)
    want = rope(x.transpose(1, 2), pos).transpose(1, 2)
    assert torch.equal(rope.rotate_tokens_first(x, pos), want)
    with pytest.raises(ValueError, match="positions shape"):
        rope.rotate_tokens_first(x, pos[..., :-1])


def test_leaving_the_fast_path_is_logged_once(caplog, monkeypatch):
    """A planned paged step that cannot take the fast path says why, once, on the selfattn
    logger; the module path's logits are unchanged by it."""
    from selfattn import _log

    model = _llama(21)
    prompts, tokens = _case(22, 2, ragged=False)
    handle = _hooked(model)
    monkeypatch.setattr(_log, "_said", set())  # as tests/test_fallback_logging.py's fixture
    with caplog.at_level(logging.INFO, logger="selfattn"):
        _decode(model, prompts, tokens)
        _decode(model, prompts, tokens)
    handle.remove()
    said = [r.getMessage() for r in caplog.records if "fast path" in r.getMessage()]
    assert said == [
        "selfattn: Llama's paged decode steps run module by module (module hooks are "
        "registered), not the fast path"
    ]


# -- packed steps (the serving engine's), quantised projections and pages, sinks ----------------

# new tokens per sequence per step (0: not in the step): a prefill with a long chunk (a query
# block over gathered K/V) and short ones, decode tokens, short chunks (speculative verify)
_SCHEDULE = [(20, 5, 3), (1, 1, 1), (3, 1, 2), (1, 0, 1), (16, 1, 1)]


def _packed(model, schedule=_SCHEDULE, *, kv_dtype=None, seed=0):
    """Logits of packed steps (:meth:`PagedKV.plan_packed`) of three sequences, flat."""
    c = model.config
    kv = PagedKV(c.n_layers, 48, 4, c.n_kv_heads, c.head_dim, max_seqs=3, max_pages_per_seq=16,
                 dtype=kv_dtype or model.norm.weight.dtype)  # fmt: skip
    ids = kv.add_sequences(3)
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for counts in schedule:
            run = [b for b in range(3) if counts[b]]
            tokens = torch.randint(0, VOCAB, (1, sum(counts)), generator=g)
            step = kv.plan_packed([ids[b] for b in run], [counts[b] for b in run])
            out.append(model(tokens, cache=step).flatten())
    kv.check()
    return torch.cat(out)


@pytest.fixture
def fast_runs(monkeypatch):
    """The number of steps that took the model-level fast path."""
    runs = []
    original = decode_fast.FastBlocks.run

    def counted(self, *args):
        runs.append(1)
        return original(self, *args)

    monkeypatch.setattr(decode_fast.FastBlocks, "run", counted)
    return runs


@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float32, torch.int8),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
    ids=["fp32", "bf16", "fp32-int8-pages", "bf16-fp8-pages"],
)
def test_packed_steps_take_the_fast_path_bitwise_equal_module_path(dtype, kv_dtype, fast_runs):
    model = _llama(31).to(dtype)
    fast = _packed(model, kv_dtype=kv_dtype)
    assert len(fast_runs) == len(_SCHEDULE)
    with _module_path():
        slow = _packed(model, kv_dtype=kv_dtype)
    assert len(fast_runs) == len(_SCHEDULE)  # the module path ran no fast step
    assert torch.equal(fast, slow)


def _quantised(model, fmt: str):
    """``model`` with every block's projection a QuantizedLinear of format ``fmt``."""
    for block in model.layers:
        att, mlp = block.self_attention, block.mlp
        for owner, name in ((att, "qkv_proj"), (att, "out_proj"), (mlp, "gate"), (mlp, "up"),
                            (mlp, "down")):  # fmt: skip
            lin = getattr(owner, name)
            setattr(owner, name, QuantizedLinear.from_float(lin.weight.detach(), fmt,
                                                            bias=lin.bias))  # fmt: skip
    return model


def _dequantised(model, dtype=torch.float64):
    """A copy of ``model`` in ``dtype`` whose QuantizedLinear layers are ``nn.Linear`` layers of
    their dequantised weights: the reference a quantised model's paths are measured against."""
    ref = copy.deepcopy(model)
    for mod in list(ref.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, QuantizedLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight = nn.Parameter(child.dequantize(dtype), requires_grad=False)
                if child.bias is not None:
                    lin.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
                setattr(mod, name, lin)
    return ref.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantised_projections_take_the_fused_kernel_step(fmt, dtype, fast_runs, monkeypatch):
    """A kept-quantised GGUF model's blocks (QuantizedLinear projections) run the lean step as
    fused kernel calls (qmm.Step: norm, RoPE, SwiGLU and residuals inside), uniform and packed,
    calling no module; its logits are as close to the dequantised model's in fp64 as the module
    path's (ratio rule; they differ from the module path's by the order of the norm's sum)."""
    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    model = _quantised(_llama(32, **cfg), fmt).to(dtype)
    calls, fused = [], []
    original = SwiGLU.forward
    monkeypatch.setattr(SwiGLU, "forward", lambda self, x: calls.append(1) or original(self, x))
    step_call = qmm.Step.__call__
    monkeypatch.setattr(
        qmm.Step, "__call__", lambda s, *a, **k: fused.append(1) or step_call(s, *a, **k)
    )
    prompts, tokens = _case(33, 2, True)

    def logits(m):
        return torch.cat([_decode(m, prompts, tokens), _packed(m)]).double()

    fast = logits(model)
    assert calls == [] and len(fast_runs) == 2 + 4 + len(_SCHEDULE) and fused
    n_fused = len(fused)
    with _module_path():
        slow = logits(model)
        ref = logits(_dequantised(model))
    assert calls and len(fused) == n_fused  # the module path ran no fused step
    assert_close_to_reference(fast, ref, slow, dtype=dtype, what="fused step's logits")


def test_fused_kernel_steps_follow_new_weights_and_dtypes(fast_runs):
    """The fused kernel calls keep pointers into the layers' buffers: loading other weights
    (``load_state_dict(assign=True)``) or ``.to(dtype)`` replaces those, and the next step
    uses the new ones (the logits follow the module path's within the ratio rule)."""
    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    model = _quantised(_llama(35, **cfg), "q4_1")
    other = _quantised(_llama(36, **cfg), "q4_1")
    prompts, tokens = _case(35, 1, False)
    before = _decode(model, prompts, tokens)
    model.load_state_dict(other.state_dict(), assign=True)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        fast = _decode(model, prompts, tokens).double()
        with _module_path():
            slow = _decode(model, prompts, tokens).double()
            ref = _decode(_dequantised(model), prompts, tokens)
        assert_close_to_reference(fast, ref, slow, dtype=dtype, what=f"{dtype} after the load")
        assert not torch.allclose(fast, before.double(), rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_blocks_equal_the_blocks_own_steps(dtype, monkeypatch):
    """After the first block's fused step, the other blocks of a decode step run as one C call
    (native_blocks: the same kernel calls on the same buffers): the logits equal those of every
    block running its own step, bit for bit, uniform and packed; a prefill chunk (another
    attention path) and sinks (which the C loop does not take) run block by block."""
    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    model = _quantised(_llama(37, **cfg), "q4_1").to(dtype)
    prompts, tokens = _case(37, 2, True)
    used = []
    native = decode_fast.native_blocks

    def counted(*a):
        run = native(*a)
        used.append(run is not None)
        return run

    monkeypatch.setattr(decode_fast, "native_blocks", counted)
    fast = torch.cat([_decode(model, prompts, tokens), _packed(model)])
    assert sum(used) >= 4 and not all(used)  # decode steps; not the prefills
    monkeypatch.setattr(decode_fast, "native_blocks", lambda *a: None)
    assert torch.equal(fast, torch.cat([_decode(model, prompts, tokens), _packed(model)]))
    monkeypatch.setattr(decode_fast, "native_blocks", native)
    _with_sinks(model, 37)
    used.clear()
    calls = []
    monkeypatch.setattr(decode_fast, "native_blocks", lambda *a: calls.append(native(*a)) or None)
    _decode(model, prompts, tokens)
    assert calls and all(c is None for c in calls)


def test_block_forward_runs_its_lean_step(fast_runs, monkeypatch):
    """A block called as a module over a paged step's layer runs the same lean step: a hook on
    one block's part sends that block (only) through its modules, the logits unchanged."""
    from selfattn.nn.blocks import RowsStep

    model = _llama(34)
    steps = []
    original = RowsStep.__call__
    monkeypatch.setattr(RowsStep, "__call__", lambda s, *a: steps.append(1) or original(s, *a))
    with _module_path():
        want = _packed(model)
    handle = _hooked(model)  # layer 1's SwiGLU: the model-level loop declines
    try:
        got = _packed(model)
    finally:
        handle.remove()
    assert fast_runs == [] and len(steps) == (len(model.layers) - 1) * len(_SCHEDULE)
    assert torch.equal(got, want)


def _with_sinks(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    for block in model.layers:
        att = block.self_attention
        att.sinks = nn.Parameter(torch.randn(att.n_heads, generator=g) * 2)
    return model


def test_packed_steps_apply_attention_sinks():
    """Sinks (gpt-oss) in a packed step, rows and query blocks: each sequence's logits equal its
    steps run alone (uniform plans), and differ from the model without sinks."""
    model = _with_sinks(_llama(35), 36)
    schedule = [(20, 5, 3), (1, 1, 1), (3, 1, 2)]
    packed = _packed(model, schedule)
    g = torch.Generator().manual_seed(0)  # _packed's draws, in its order
    draws = [torch.randint(0, VOCAB, (1, sum(c)), generator=g)[0] for c in schedule]
    cache = model.make_cache("paged", 3, 64, page_size=4)
    alone = []
    with torch.no_grad():
        for counts, tokens in zip(schedule, draws):
            for b, n in enumerate(counts):
                row = cache.cache.view([cache.seq_ids[b]])
                start = sum(counts[:b])
                alone.append(model(tokens[None, start : start + n], cache=row).flatten())
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    for block in model.layers:
        block.self_attention.sinks = None
    assert not torch.allclose(packed, _packed(model, schedule), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("packed", [False, True])
def test_attend_rows_refuses_bad_shapes_and_undoes_the_step(packed):
    kv = PagedKV(2, 8, 4, 2, 8, max_seqs=2, max_pages_per_seq=4)
    a, b = kv.add_sequences(2)
    g = torch.Generator().manual_seed(37)
    for bad_q, bad_k in ((True, False), (False, True)):
        step = kv.plan_packed([a, b], [2, 1]) if packed else kv.view([a, b]).plan(2)
        B, S = (1, 3) if packed else (2, 2)
        q = torch.randn(B, S + bad_q, 4, 8, generator=g)
        k = torch.randn(B * S - bad_k, 2, 8, generator=g)
        v = torch.randn(B * S, 2, 8, generator=g)
        with pytest.raises(ValueError, match=r"q must be|k_rows and v_rows must be"):
            step.layers[0].attend_rows(q, k, v)
        assert (kv.length(a), kv.length(b)) == (0, 0)  # undone
    kv.check()


def test_block_called_by_hand_over_a_paged_layer_equals_its_modules(monkeypatch):
    """A DecoderBlock called by hand over a planned paged step's layer, without positions
    (they default to each sequence's own length, as the attention's forward does)."""
    from selfattn.nn.blocks import RowsStep

    steps = []
    original = RowsStep.__call__
    monkeypatch.setattr(RowsStep, "__call__", lambda s, *a: steps.append(1) or original(s, *a))
    model = _llama(38)
    block = model.layers[0]
    c = model.config
    g = torch.Generator().manual_seed(39)
    x = [torch.randn(2, n, c.d_model, generator=g) for n in (5, 1, 1)]
    outs = []
    for hooked in (False, True):
        kv = PagedKV(1, 16, 4, c.n_kv_heads, c.head_dim, max_seqs=2, max_pages_per_seq=4)
        view = kv.view(kv.add_sequences(2))
        with torch.no_grad(), _module_path() if hooked else contextlib.nullcontext():
            outs.append(torch.cat([block(h, cache=view.plan(h.shape[1]).layers[0]).flatten()
                                   for h in x]))  # fmt: skip
    assert len(steps) == len(x) and torch.equal(*outs)
