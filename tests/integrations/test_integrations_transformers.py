"""``attn_implementation="selfattn"`` (selfattn.integrations.transformers) against transformers.

Tiny random-weight models of each family are perturbed, saved with ``save_pretrained`` and loaded
with ``from_pretrained`` twice: with ``"selfattn"`` and with transformers' own implementation
(``sdpa``, or ``eager`` where the family has no sdpa: Gemma-2's softcap, gpt-oss's sinks). Float
results follow the ratio rule: selfattn's fp32 error against a float64 oracle is at most 2x (3x
for gradients) transformers' own fp32 error, plus a few ulps. The oracle is the same model in
float64 with the textbook attention below on transformers' own dense masks (transformers' eager
is no fp64 oracle: it takes its softmax in float32). Greedy generations must be token-equal, and
the mask translation is checked exactly against transformers' dense masks.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import selfattn  # noqa: E402
from selfattn import masks  # noqa: E402
from selfattn.integrations import transformers as st  # noqa: E402
from selfattn.testing import assert_close_to_reference, perturb_parameters  # noqa: E402

mu = pytest.importorskip("transformers.masking_utils")

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 97
S = 9  # longer than every window below, so windowed layers really drop keys
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
)
# family -> (config class, options, auto class, transformers' implementation to compare with)
FAMILIES = {
    "llama": ("LlamaConfig", _COMMON, "AutoModelForCausalLM", "sdpa"),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=3), "AutoModelForCausalLM", "sdpa"),
    "qwen2": (  # MQA; layer 1 windowed, layer 0 full
        "Qwen2Config",
        dict(
            _COMMON,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
        "AutoModelForCausalLM",
        "sdpa",
    ),
    "gemma2": (  # alternating window / full layers; a cap of 1 really bends the scores
        "Gemma2Config",
        dict(_COMMON, head_dim=8, sliding_window=3, attn_logit_softcapping=1.0),
        "AutoModelForCausalLM",
        "eager",
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_inner=48,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "AutoModelForCausalLM",
        "sdpa",
    ),
    "bert": (
        "BertConfig",
        dict(
            _COMMON,
            num_key_value_heads=None,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        "AutoModelForMaskedLM",
        "sdpa",
    ),
    "gpt_oss": (  # sinks, alternating windows, MoE
        "GptOssConfig",
        dict(
            _COMMON,
            head_dim=8,
            sliding_window=3,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size=32,
        ),
        "AutoModelForCausalLM",
        "eager",
    ),
}
DECODERS = [f for f in FAMILIES if f != "bert"]


ORACLE = "selfattn-test-oracle"


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Textbook attention on transformers' dense boolean mask, in the inputs' dtype (float64):
    K/V repeated per query head, softcap, then the mask, then sinks as one more softmax column.
    A row with no key gives 0 (its softmax taken over zeros, then zeroed, so gradients stay
    finite)."""
    n = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = query @ key.transpose(-1, -2) * scale  # (B, Hq, Sq, Sk)
    if kw.get("softcap") is not None:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    allowed = torch.ones_like(s, dtype=torch.bool) if attention_mask is None else attention_mask
    empty = ~allowed.any(-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    sinks = kw.get("s_aux")
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = (p[..., :-1] if sinks is not None else p) * ~empty
    return (p @ value).transpose(1, 2).contiguous(), p


def _oracle_mask(*args, **kwargs):
    """transformers' dense boolean mask, never skipped (the oracle has no is_causal shortcut)."""
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return mu.sdpa_mask(*args, **kwargs)


transformers.AttentionInterface.register(ORACLE, _oracle_attention)
mu.AttentionMaskInterface.register(ORACLE, _oracle_mask)


def _save(family: str, folder, seed: int) -> None:
    cls_name, options, auto, _ = FAMILIES[family]
    options = {k: v for k, v in options.items() if v is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        cfg = getattr(transformers, cls_name)(**options)
        cfg.pad_token_id = 0
        torch.manual_seed(seed)
        model = getattr(transformers, auto).from_config(cfg)
        perturb_parameters(model, seed, scale=0.3)  # sinks, norms and biases off their init
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = None  # generate() runs its full length
        model.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for i, family in enumerate(FAMILIES):
        out[family] = tmp_path_factory.mktemp(family)
        _save(family, out[family], seed=i)
    return out


def load(folders, family: str, impl: str, **kwargs):
    auto = getattr(transformers, FAMILIES[family][2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_pretrained(folders[family], attn_implementation=impl, **kwargs).eval()


def oracle_of(model):
    """The same model in float64 on the oracle attention (and eager MoE experts: grouped_mm
    has no float64)."""
    oracle = copy.deepcopy(model).double()
    oracle.set_attn_implementation(ORACLE)
    if getattr(oracle.config, "num_local_experts", None):
        oracle.set_experts_implementation("eager")
    return oracle


def trio(folders, family: str):
    """``(selfattn model, transformers' model, the float64 oracle)``."""
    theirs = load(folders, family, FAMILIES[family][3])
    return load(folders, family, "selfattn"), theirs, oracle_of(theirs)


def padded_batch(family: str, seed: int, B: int = 3):
    """Random ids and a 0/1 mask: left padding for decoders (as generate() needs), right
    padding for BERT; row 1 has none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, p in enumerate([3, 0, 1][:B]):
        if family == "bert":
            mask[b, S - p :] = 0
        else:
            mask[b, :p] = 0
    return ids, mask


# transformers' own fp32 result lies this close (relative to the largest value) to the oracle: a
# check on the oracle itself, as the ratio rule bounds only selfattn's error
ORACLE_AGREES = 1e-4


def assert_model_close(ours, theirs, oracle, *, factor: float = 2.0, what: str = "logits"):
    """The ratio rule on model outputs: ``ours`` and ``theirs`` are fp32, ``oracle`` fp64."""
    scale = max(1.0, oracle.abs().max().item())
    gap = (theirs.double() - oracle).abs().max().item()
    assert gap <= ORACLE_AGREES * scale, f"{what}: the oracle is {gap:.2e} from transformers"
    assert_close_to_reference(
        ours.detach(),
        oracle.detach(),
        theirs.detach(),
        factor=factor,
        dtype=torch.float32,
        what=what,
    )


# -- parity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_logits_match_transformers(folders, family):
    ours, theirs, oracle = trio(folders, family)
    ids, mask = padded_batch(family, seed=1)
    keep = mask.bool()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        ref = theirs(ids, attention_mask=mask).logits
        o64 = oracle(ids, attention_mask=mask).logits
    assert got.shape == (3, S, VOCAB)
    assert_model_close(got[keep], ref[keep], o64[keep])


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_generate_is_token_equal(folders, family):
    """Prefill on a left-padded batch, then decode 7 tokens through transformers' DynamicCache
    (Sq = 1, Sk > 1: bottom-right alignment; windows slide past the prompt)."""
    ours, theirs, _ = trio(folders, family)
    ids, mask = padded_batch(family, seed=2)
    args = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ours.generate(ids, **args)
        ref = theirs.generate(ids, **args)
    assert got.shape == (3, S + 7)
    assert torch.equal(got, ref), f"selfattn generated\n{got}\ntransformers\n{ref}"


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_generate_with_a_static_cache(folders, family):
    """A StaticCache holds max_cache_len keys from the start: the prefill's queries sit at
    positions 0..S-1 of a longer key range (q_offset != Sk - Sq), and generate() builds the
    masks once and hands them back to the model."""
    ours, theirs, _ = trio(folders, family)
    ids, mask = padded_batch(family, seed=9)
    args = dict(
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ours.generate(ids, **args)
        ref = theirs.generate(ids, **args)
    assert torch.equal(got, ref), f"selfattn generated\n{got}\ntransformers\n{ref}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_decode_step_equals_full_forward(folders, family):
    """The last position's logits from prefill + one cached step equal one full forward."""
    ours = load(folders, family, "selfattn")
    ids, _ = padded_batch(family, seed=3, B=2)
    with torch.no_grad():
        full = ours(ids).logits[:, -1]
        cache = transformers.DynamicCache(config=ours.config)
        ours(ids[:, :-1], cache=cache, use_cache=True)
        step = ours(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_packed_sequences_attend_within_their_document(folders, family):
    """position_ids restarting at 0 (no padding, no cache) pack three sequences into one row;
    each must see only itself: equal to running each alone, and to transformers."""
    ours, theirs, oracle = trio(folders, family)
    lengths = [4, 2, 5]  # 4 and 5 are longer than the windows of 3
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=pos, use_cache=False).logits
        ref = theirs(ids, position_ids=pos, use_cache=False).logits
        o64 = oracle(ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat(
            [ours(part, use_cache=False).logits for part in ids.split(lengths, dim=1)], dim=1
        )
    assert_model_close(got, ref, o64)
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)


def test_flash_varlen_kwargs_pack_sequences(folders):
    """cu_seq_lens_q / cu_seq_lens_k (flash-attn's varlen form, as DataCollatorWithFlattening
    gives them) keep packed sequences apart even where transformers' mask does not (an explicit
    all-ones attention_mask turns its position_ids detection off)."""
    model = load(folders, "mistral", "selfattn")
    lengths = [4, 2, 5]
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        got = model(ids, attention_mask=ones, position_ids=pos, use_cache=False, **varlen).logits
        alone = torch.cat([model(p).logits for p in ids.split(lengths, dim=1)], dim=1)
        with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 4, 6, 11\].*B = 1"):
            model(ids.expand(2, -1), position_ids=pos, use_cache=False, **varlen)
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "bert"])
def test_output_attentions_match_eager_weights(folders, family):
    """Weights only when asked, equal to eager's (gpt-oss: each row's keys share what the sink
    leaves them, so rows sum to less than 1)."""
    ours = load(folders, family, "selfattn")
    eager = load(folders, family, "eager")
    oracle = oracle_of(eager)
    ids, mask = padded_batch(family, seed=5)
    with torch.no_grad():
        assert ours(ids, attention_mask=mask).attentions is None
        got = ours(ids, attention_mask=mask, output_attentions=True).attentions
        ref = eager(ids, attention_mask=mask, output_attentions=True).attentions
        o64 = oracle(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(ref) == 2
    rows = mask.bool()[:, None, :, None]  # real query rows; padded rows differ by convention
    for layer, (a, b, o) in enumerate(zip(got, ref, o64)):
        assert a.shape == b.shape == (3, 4, S, S)
        sel = rows.expand_as(a)
        assert_model_close(a[sel], b[sel], o[sel], what=f"layer {layer} weights")
    if family == "gpt_oss":
        assert float(got[0].sum(-1)[rows[..., 0].expand(-1, 4, -1)].min()) < 1 - 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "bert"])
def test_training_step_gradients_match(folders, family):
    """One loss.backward() in train mode: every parameter's gradient (gpt-oss's sinks too)."""
    ours, theirs, oracle = trio(folders, family)
    ids, mask = padded_batch(family, seed=6)
    labels = ids.masked_fill(mask == 0, -100)
    if family != "bert":  # a padding position's prediction of the first token: not a real row
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    grads = []
    for model in (ours, theirs, oracle):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    if family == "gpt_oss":
        assert any("sinks" in n for n in grads[0])
    for name in grads[0]:
        assert_model_close(
            grads[0][name], grads[1][name], grads[2][name], factor=3.0, what=f"grad {name}"
        )


def test_training_dropout_is_selfattns_with_the_layers_p(folders):
    """With attention_dropout > 0 in train mode the layer calls selfattn.attention with that p
    (same seed, same drop pattern), and eval mode drops nothing."""
    model = load(folders, "llama", "selfattn", attention_dropout=0.4)
    layer = model.model.layers[0].self_attn
    q = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(7))
    k, v = q[:, :2].flip(2), q[:, 2:] * 0.5
    layer.train()
    torch.manual_seed(11)
    got, _ = st.attention_forward(layer, q, k, v, None, dropout=0.4)
    torch.manual_seed(11)
    want = selfattn.attention(q, k, v, mask=masks.causal(), dropout_p=0.4)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=0)
    ids, _ = padded_batch("llama", seed=7)
    with torch.no_grad():
        model.train()
        torch.manual_seed(0)
        a = model(ids, use_cache=False).logits
        model.eval()
        b = model(ids, use_cache=False).logits
        c = model(ids, use_cache=False).logits
    assert not torch.allclose(a, b) and torch.equal(b, c)


def test_set_attn_implementation_switches_a_loaded_model(folders, monkeypatch):
    model = load(folders, "qwen2", "sdpa")
    ids, mask = padded_batch("qwen2", seed=8)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        seen = []
        real = st.attention

        def spy(q, k, v, **kw):
            seen.append((q.shape[1], k.shape[1]))
            return real(q, k, v, **kw)

        monkeypatch.setattr(st, "attention", spy)
        model.set_attn_implementation("selfattn")
        after = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "selfattn"
    assert seen == [(4, 1), (4, 1)]  # GQA/MQA: K/V reach selfattn with their 1 head, unrepeated
    keep = mask.bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=1e-5, atol=1e-5)


# -- masks: transformers' mask requests become selfattn masks --------------------------------------


def _cfg(impl: str, **options):
    cfg = transformers.MistralConfig(**{**_COMMON, **options})
    cfg._attn_implementation = impl
    return cfg


def _mask_cases():
    """(id, make(config, embeds) -> transformers' mask call) over windows, padding and packing."""
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 1, 1, 1, 1, 1, 1]])
    right = left.flip(-1)
    holes = torch.tensor([[1, 0, 1, 1, 0, 1, 1]] * 3)
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1]]).expand(3, -1)

    def causal(am=None, pos=None):
        return lambda c, e: mu.create_causal_mask(c, e, am, None, position_ids=pos)

    def window(am=None, pos=None):
        return lambda c, e: mu.create_sliding_window_causal_mask(c, e, am, None, position_ids=pos)

    def bidirectional(am=None):
        return lambda c, e: mu.create_bidirectional_mask(c, e, am)

    return {
        "causal": (causal(), "causal()"),
        "causal-left-padded": (causal(left), "(causal() & ~padding([2, 0, 1]))"),
        "causal-key-holes": (causal(holes), "(causal() & from_tensor(<bool (3, 1, 1, 7)>))"),
        "window-right-padded": (window(right), "(sliding_window(3) & padding([5, 7, 6]))"),
        "causal-packed": (causal(None, packed), "(causal() & documents(<ids (3, 7)>))"),
        "window-packed": (window(None, packed), "(sliding_window(3) & documents(<ids (3, 7)>))"),
        "bidirectional": (bidirectional(), "None"),
        "bidirectional-right-padded": (bidirectional(right), "padding([5, 7, 6])"),
    }


@pytest.mark.parametrize("case", list(_mask_cases()))
def test_masks_become_selfattn_masks_equal_to_transformers(case):
    make, expect = _mask_cases()[case]
    embeds = torch.zeros(3, 7, 1)
    prepared = make(_cfg("selfattn", sliding_window=3), embeds)
    dense = make(_cfg(ORACLE, sliding_window=3), embeds)  # transformers' own, True = attend
    assert isinstance(prepared, st.PreparedMask)
    assert repr(prepared.mask) == expect  # structured: no (B, 1, Sq, Sk) tensor
    dense = torch.ones(1, 1, 7, 7, dtype=torch.bool) if dense is None else dense
    got = (
        torch.ones(3, 1, 7, 7, dtype=torch.bool)
        if prepared.mask is None
        else prepared.mask.to_dense(7, 7, B=3, q_offset=prepared.q_offset)
    )
    assert torch.equal(got, dense.expand(3, 1, 7, 7))


@pytest.mark.parametrize("past", [2, 6])
def test_masks_follow_a_sliding_cache_offsets(past):
    """Decoding past a window: the sliding cache layer keeps w - 1 keys (kv_offset > 0); the
    mask must cover exactly the keys the layer holds, padding of dropped keys cut away."""
    cfg = _cfg("selfattn", sliding_window=3, num_hidden_layers=1)
    eager = _cfg(ORACLE, sliding_window=3, num_hidden_layers=1)
    cache = transformers.DynamicCache(config=cfg)
    k = torch.zeros(2, 2, past, 8)
    cache.update(k, k, 0)
    am = torch.ones(2, past + 1, dtype=torch.long)
    am[0, :2] = 0
    embeds = torch.zeros(2, 1, 1)
    prepared = mu.create_sliding_window_causal_mask(cfg, embeds, am, cache)
    dense = mu.create_sliding_window_causal_mask(eager, embeds, am, cache)
    Sk = dense.shape[-1]
    got = prepared.mask.to_dense(1, Sk, B=2, q_offset=prepared.q_offset)
    assert prepared.shape == (2, 1, 1, Sk)
    assert torch.equal(got, dense.expand(2, 1, 1, Sk))


def test_unknown_mask_function_falls_back_to_the_dense_mask_logged_once(caplog):
    """A model's own or_mask_function has no selfattn equivalent: the dense boolean mask
    (transformers' own) is used, and the selfattn logger says so once."""

    def every_third(b, h, q, kv):
        return kv % 3 == 0

    cfg, eager = _cfg("selfattn"), _cfg(ORACLE)
    embeds = torch.zeros(2, 6, 1)
    st._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="selfattn"):
        for _ in range(2):
            prepared = mu.create_causal_mask(cfg, embeds, None, None, or_mask_function=every_third)
    dense = mu.create_causal_mask(eager, embeds, None, None, or_mask_function=every_third)
    assert isinstance(prepared.mask, masks.TensorMask)
    assert torch.equal(prepared.mask.to_dense(6, 6, B=2), dense.expand(2, 1, 6, 6))
    assert len([r for r in caplog.records if "dense" in r.getMessage()]) == 1


# -- registration, laziness, errors ---------------------------------------------------------------


def test_register_returns_the_name_and_is_idempotent():
    from transformers import AttentionInterface

    assert st.register() == "selfattn" == st.NAME
    first = AttentionInterface._global_mapping["selfattn"]
    assert st.register() == "selfattn"
    assert AttentionInterface._global_mapping["selfattn"] is first is st.attention_forward
    assert st.register("selfattn-chunked", backend="chunked") == "selfattn-chunked"
    pinned = AttentionInterface._global_mapping["selfattn-chunked"]
    st.register("selfattn-chunked", backend="chunked")
    assert AttentionInterface._global_mapping["selfattn-chunked"] is pinned


@pytest.mark.parametrize(
    "name, backend, match",
    [("my-sdpa", "auto", "my-sdpa"), ("", "auto", "non-empty"), ("x", "nope", "nope")],
)
def test_register_rejects_bad_names_and_backends(name, backend, match):
    with pytest.raises((ValueError, KeyError), match=match):
        st.register(name, backend=backend)


def test_import_selfattn_does_not_import_the_integration():
    run = subprocess.run(
        [sys.executable, "-c", "import sys, selfattn; print(sorted(sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "selfattn.integrations" not in run.stdout and "'transformers" not in run.stdout


def test_the_integration_imports_without_transformers_and_says_how_to_get_it(monkeypatch):
    """A fresh copy of the module, run with transformers unimportable: it loads, registers
    nothing, and register() names the missing package."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    spec = importlib.util.spec_from_file_location("selfattn_tf_copy", st.__file__)
    copy_ = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy_)
    spec.loader.exec_module(copy_)
    with pytest.raises(ImportError, match="pip install transformers"):
        copy_.register()


def test_errors_name_the_shapes_and_the_fix(folders):
    layer = load(folders, "llama", "selfattn").model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    stale = st.PreparedMask(masks.causal(), 0, 1, 3, 4)
    with pytest.raises(ValueError, match=r"\(1, 3, 4\).*\(1, 3, 5\)"):
        st.attention_forward(layer, q, k, k, stale)
    with pytest.raises(TypeError, match="attention_mask of type list"):
        st.attention_forward(layer, q, k, k, [1, 2])
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\).*got \(3,\)"):
        st.attention_forward(layer, q, k, k, None, s_aux=torch.zeros(3))
