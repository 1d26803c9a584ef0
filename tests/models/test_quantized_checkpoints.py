"""Quantised transformers checkpoints (``selfattn.models.hf_quant``): AWQ, GPTQ and
compressed-tensors' pack-quantized layers loaded as QuantizedLinear.

Tiny random Llama / Qwen2 models are quantised here (round to nearest) and packed by packers
written from the formats' specs, as the real tools pack (AutoAWQ's ``WQLinear_GEMM.from_linear``,
gptqmodel's ``pack_original`` and its v2 -> v1 zero points, compressed-tensors'
``pack_to_int32``), then saved as safetensors with transformers' config and the
``quantization_config``. ``from_pretrained`` must make every packed projection a QuantizedLinear
(q/k/v fused) whose ``dequantize()`` is the spec's fp64 ``(u - z) · s`` within the ratio rule
(the fp16 rounding of the minimums against fp16 arithmetic on the spec), and logits those of a
float64 model of the dequantised weights. Each refused option and broken tensor is named.
"""

from __future__ import annotations

import copy
import json
from typing import NamedTuple

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
save_file = pytest.importorskip("safetensors.torch").save_file

from selfattn import _log  # noqa: E402  # isort: skip
from selfattn.models import CheckpointError, UnsupportedConfigError, from_pretrained  # noqa: E402  # isort: skip
from selfattn.nn import QuantizedLinear  # noqa: E402  # isort: skip
from selfattn.testing import assert_close_to_reference  # noqa: E402  # isort: skip

SIZES = dict(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v biases
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' layer -> ours (q/k/v fuse into qkv_proj)
OURS = {
    "o_proj": "self_attention.out_proj",
    "gate_proj": "mlp.gate",
    "up_proj": "mlp.up",
    "down_proj": "mlp.down",
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm.py: nibble i holds column 8c + order[i]
IDS = torch.tensor([[5, 17, 3, 88, 41, 2, 60, 9, 33], [1, 96, 50, 7, 7, 23, 70, 11, 4]])


class Spec(NamedTuple):
    """One layer as its format defines it: ``w = (u - z) · s``, codes ``u (N, K)``, zero points
    ``z (N, G)`` (both unsigned), scales ``s (N, G)`` in the checkpoint's dtype."""

    u: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor

    def weight(self, dtype=torch.float64) -> torch.Tensor:
        """The dequantisation, computed in ``dtype`` (fp16: the packers' kernels' arithmetic)."""
        N, K = self.u.shape
        G = self.s.shape[1]
        q = (self.u.view(N, G, K // G) - self.z.unsqueeze(-1)).to(dtype)
        return (q * self.s.to(dtype).unsqueeze(-1)).view(N, K)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, dtype) -> Spec:
    """Round to nearest, one scale (and zero point) per ``group`` inputs: symmetric around
    ``2^(bits-1)`` with ``s = max|w| / (2^bits - 1) · 2`` (compressed-tensors' observer: the
    negative extreme reaches code 0, i.e. -2^(bits-1)), else min-max as AutoAWQ's
    ``pseudo_quantize_tensor``."""
    N, K = w.shape
    x = w.double().view(N, K // group, group)
    top = 2**bits - 1
    if sym:
        s = (x.abs().amax(-1) / (top / 2)).to(dtype)
        z = torch.full(s.shape, 2 ** (bits - 1), dtype=torch.long)
    else:
        lo, hi = x.amin(-1), x.amax(-1)
        s = ((hi - lo) / top).clamp(min=1e-5).to(dtype)
        z = (-(lo / s.double()).round()).clamp(0, top).long()
    u = ((x / s.double().unsqueeze(-1)).round() + z.unsqueeze(-1)).clamp(0, top).long()
    return Spec(u.view(N, K), z, s)


def int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values of 32 bits -> the int32 of the same bits."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def fields(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``(R, C)`` values -> ``(R, C · bits / 32)`` int32 words, field ``i`` of a word at bit
    ``bits · i`` (gptqmodel's and compressed-tensors' order; C padded with zeros to whole
    words, as ``pack_to_int32`` pads)."""
    per = 32 // bits
    v = nn.functional.pad(v.long(), (0, -v.shape[1] % per))
    shifts = torch.arange(per) * bits
    return int32((v.view(v.shape[0], -1, per) << shifts).sum(-1))


def pack_awq(q: Spec, **_) -> dict:
    N = q.u.shape[0]

    def ordered(v):  # (R, N) -> (R, N/8) words in AutoAWQ's nibble order
        return fields(v.view(v.shape[0], N // 8, 8)[:, :, AWQ_ORDER].reshape(v.shape[0], N), 4)

    return {"qweight": ordered(q.u.T), "qzeros": ordered(q.z.T), "scales": q.s.T.contiguous()}


def pack_gptq(q: Spec, bits: int, v1: bool = True, shuffle: bool = False, **_) -> dict:
    """``shuffle``: g_idx of desc_act, the inputs dealt to the groups in another order (the
    codes stay those of ``q``: only what the index claims matters to the loader)."""
    K, G = q.u.shape[1], q.s.shape[1]
    qzeros = fields(q.z.T, bits)
    if v1:  # gptqmodel's v2 -> v1: each word less 0x11111111 (0x01010101 at 8 bits)
        qzeros = int32(qzeros.long() - {4: 0x11111111, 8: 0x01010101}[bits])
    g_idx = torch.arange(K) // (K // G)
    if shuffle:
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(K))]
    return {
        "qweight": fields(q.u, bits).T.contiguous(),
        "qzeros": qzeros,
        "scales": q.s.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def pack_ct(q: Spec, bits: int, sym: bool, zp: str = "packed", **_) -> dict:
    N, K = q.u.shape
    out = {
        "weight_packed": fields(q.u, bits),
        "weight_scale": q.s,
        "weight_shape": torch.tensor([N, K]),
    }
    if not sym and zp == "packed":  # pack_to_int32(zp, packed_dim=0): zp + 2^(bits-1) along N
        out["weight_zero_point"] = fields(q.z.T, bits).T.contiguous()
    elif not sym:  # older compressed-tensors: the signed zero points as int8
        out["weight_zero_point"] = (q.z - 2 ** (bits - 1)).to(torch.int8)
    return out


PACKERS = {"awq": pack_awq, "gptq": pack_gptq, "compressed-tensors": pack_ct}


def qconfig(method: str, bits=4, group=64, sym=False, **extra) -> dict:
    if method == "awq":
        c = dict(
            bits=bits,
            group_size=group,
            version="gemm",
            zero_point=True,
            modules_to_not_convert=None,
        )
    elif method == "gptq":
        c = dict(bits=bits, group_size=group, sym=sym, desc_act=False, checkpoint_format="gptq")
    else:
        weights = dict(
            num_bits=bits,
            type="int",
            symmetric=sym,
            dynamic=False,
            actorder=None,
            strategy="group" if group else "channel",
            group_size=group,
        )
        group0 = dict(
            targets=["Linear"],
            weights=weights,
            input_activations=None,
            output_activations=None,
            format="pack-quantized",
        )
        c = dict(
            format="pack-quantized",
            quantization_status="compressed",
            ignore=["lm_head"],
            config_groups={"group_0": group0},
            sparsity_config={},
            kv_cache_scheme=None,
        )
    return {"quant_method": method, **c, **extra}


def write(
    folder,
    method,
    *,
    family="llama",
    bits=4,
    group=64,
    sym=False,
    dtype=torch.float16,
    skip=(),
    pack=None,
    config=None,
    tilt=0.0,
    seed=0,
):
    """A checkpoint of a random ``family`` model whose projections (those not in ``skip``) are
    quantised and packed by ``method``'s packer; returns ``{layer: Spec}``. ``tilt`` moves
    even output rows up and odd ones down by that much (zero points 0 and 15 side by side)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    hf_config = config_cls(**SIZES)
    state = {k: v.detach().contiguous() for k, v in model_cls(hf_config).state_dict().items()}
    specs = {}
    for name in [k for k in state if k.endswith("_proj.weight")]:
        layer = name.removesuffix(".weight")
        if layer.rsplit(".", 1)[1] not in PROJECTIONS or layer.rsplit(".", 1)[1] in skip:
            continue
        w = state.pop(name)
        w = w + tilt * (1 - 2 * (torch.arange(w.shape[0]) % 2)).unsqueeze(1)
        specs[layer] = q = rtn(w, bits, group or w.shape[1], sym, dtype)  # None: one per row
        packed = PACKERS[method](q, bits=bits, sym=sym, **(pack or {}))
        state.update({f"{layer}.{k}": v for k, v in packed.items()})
    folder.mkdir(exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    hf_config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config or qconfig(method, bits, group, sym)
    (folder / "config.json").write_text(json.dumps(cfg))
    return specs


def expected(specs: dict) -> dict:
    """Our module name -> the spec of its weight (q/k/v as one fused spec)."""
    out = {}
    for layer, q in specs.items():
        i, proj = layer.split(".")[2], layer.rsplit(".", 1)[1]
        if proj in OURS:
            out[f"layers.{i}.{OURS[proj]}"] = q
        elif proj == "q_proj":
            trio = [specs[layer.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[f"layers.{i}.self_attention.qkv_proj"] = Spec(*(torch.cat(t) for t in zip(*trio)))
    return out


def dense_twin(model: nn.Module) -> nn.Module:
    """``model`` with each QuantizedLinear replaced by an nn.Linear of its dequantised weight."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, QuantizedLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data = m.dequantize()
            if m.bias is not None:
                lin.bias.data = m.bias.detach().float()
            twin.set_submodule(name, lin)
    return twin


def check(folder, specs: dict, fmt: str) -> nn.Module:
    """Load ``folder``: every packed projection a QuantizedLinear of ``fmt`` whose weight is its
    spec's (ratio rule against fp16 arithmetic), the head and embedding float, and logits those
    of a float64 model of the dequantised weights."""
    model = from_pretrained(folder, dtype="float32")
    want = expected(specs)
    got = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert sorted(got) == sorted(want)
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding
    for name, layer in got.items():
        q = want[name]
        assert layer.fmt == fmt and layer.group == q.u.shape[1] // q.s.shape[1], name
        assert layer.dtype == torch.float32
        assert_close_to_reference(
            layer.dequantize(),
            q.weight(),
            q.weight(torch.float16),
            dtype=torch.float16,
            what=f"{name} weight",
        )
    twin = dense_twin(model)
    with torch.no_grad():  # (2, 9): 18 rows, past the C kernel's, on the exact dequantising path
        logits, oracle, naive = model(IDS), copy.deepcopy(twin).double()(IDS), twin(IDS)
    assert_close_to_reference(logits, oracle, naive, what="logits")
    return model


CASES = [  # (method, family, bits, group, sym, scale dtype, packing options, QuantizedLinear fmt)
    ("awq", "llama", 4, 64, False, torch.float16, {}, "int4"),
    ("awq", "qwen2", 4, 128, False, torch.float16, {}, "int4"),
    ("gptq", "llama", 4, 32, True, torch.float16, {}, "int4_sym"),
    ("gptq", "qwen2", 4, 64, False, torch.float16, {}, "int4"),
    ("gptq", "llama", 4, 128, False, torch.float16, {"v1": False}, "int4"),
    ("gptq", "llama", 8, 128, True, torch.float16, {}, "int8"),
    ("compressed-tensors", "llama", 4, 32, True, torch.bfloat16, {}, "int4_sym"),
    ("compressed-tensors", "qwen2", 4, 64, False, torch.bfloat16, {}, "int4"),
    ("compressed-tensors", "llama", 4, None, False, torch.float32, {"zp": "int8"}, "int4"),
    ("compressed-tensors", "llama", 8, None, True, torch.bfloat16, {}, "int8"),
]


@pytest.mark.parametrize(
    ("method", "family", "bits", "group", "sym", "dtype", "pack", "fmt"),
    CASES,
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_packed_layers_load_as_quantized_linear(
    tmp_path, method, family, bits, group, sym, dtype, pack, fmt
):
    config = None
    if method == "gptq" and pack.get("v1") is False:
        config = {**qconfig(method, bits, group, sym), "format": "gptq_v2"}
    specs = write(
        tmp_path,
        method,
        family=family,
        bits=bits,
        group=group,
        sym=sym,
        dtype=dtype,
        pack=pack,
        config=config,
    )
    check(tmp_path, specs, fmt)


def test_gptq_v1_zero_points_of_zero_borrow_as_gptqmodel_writes_them(tmp_path):
    """A v1 word less 0x11111111 borrows across nibbles where a zero point is 0; reading it back
    adds the whole word, as gptqmodel's v1 -> v2 does, and recovers every zero point."""
    specs = write(tmp_path, "gptq", group=32, tilt=0.5)
    z = specs["model.layers.0.mlp.up_proj"].z
    assert (z[::2] == 0).all() and (z[1::2] == 15).all()
    check(tmp_path, specs, "int4")


def test_ignored_layers_stay_float_and_mixed_qkv_dequantise(tmp_path, caplog, monkeypatch):
    """A layer the checkpoint left float (compressed-tensors' ignore) loads as nn.Linear; a q/k/v
    triple that is not all one format is dequantised into a float qkv_proj (logged)."""
    cfg = qconfig("compressed-tensors", sym=True, ignore=["lm_head", "re:.*k_proj", "re:.*up_proj"])
    specs = write(tmp_path, "compressed-tensors", sym=True, skip=("k_proj", "up_proj"), config=cfg)
    monkeypatch.setattr(_log, "_said", set())  # log_once: this process may have said it
    with caplog.at_level("INFO", logger="selfattn"):
        model = from_pretrained(tmp_path, dtype="float32")
    assert "different formats" in caplog.text
    block = model.layers[0]
    assert type(block.self_attention.qkv_proj) is nn.Linear and type(block.mlp.up) is nn.Linear
    assert isinstance(block.mlp.gate, QuantizedLinear) and block.mlp.gate.fmt == "int4_sym"
    q_rows = block.self_attention.qkv_proj.weight[: SIZES["hidden_size"]]
    q = specs["model.layers.0.self_attn.q_proj"]
    assert_close_to_reference(q_rows, q.weight(), q.weight(torch.float16), dtype=torch.float16)


def test_quantized_false_dequantises_exactly(tmp_path):
    specs = write(tmp_path, "awq", group=32)
    model = from_pretrained(tmp_path, dtype="float32", quantized=False)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    down = specs["model.layers.0.mlp.down_proj"]
    assert torch.equal(model.layers[0].mlp.down.weight, down.weight().float())


def test_bf16_model_keeps_fp16_scales_and_decodes(tmp_path):
    """A bfloat16 model reads the scales in their own fp16 (not through bf16) and runs the
    kernel's decode rows."""
    specs = write(tmp_path, "gptq", group=32, sym=True)
    model = from_pretrained(tmp_path, dtype="bfloat16")
    layer = model.layers[0].mlp.down
    assert layer.dtype == torch.bfloat16
    want = specs["model.layers.0.mlp.down_proj"].weight()
    assert torch.equal(layer.dequantize(torch.float64), want)  # int4_sym: d · (u - 8) is exact
    with torch.no_grad():
        assert torch.isfinite(model(IDS[:1, :4])).all()


# -- refused and broken checkpoints -------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "change", "match"),
    [
        ("awq", {"version": "gemv"}, r"version='gemv' \(awq\)"),
        ("awq", {"zero_point": False}, r"zero_point=False"),
        ("gptq", {"checkpoint_format": "marlin"}, r"'marlin'"),
        ("gptq", {"bits": 3}, r"bits=3"),
        ("gptq", {"bits": 8, "sym": False}, r"sym=False.*quantized=False"),
        ("compressed-tensors", {"format": "float-quantized"}, r"format='float-quantized'"),
        ("compressed-tensors", {"quantization_status": "frozen"}, r"quantization_status='frozen'"),
        ("compressed-tensors", {"weights": {"strategy": "tensor"}}, r"weights.strategy='tensor'"),
        (
            "compressed-tensors",
            {"input_activations": {"num_bits": 8, "type": "int"}},
            r"input_activations=.*quantised activations are not run",
        ),
        ("bitsandbytes", {}, r"quant_method='bitsandbytes'.*'awq'"),
    ],
)
def test_refused_options_are_named(tmp_path, method, change, match):
    packer = method if method in PACKERS else "awq"
    config = qconfig(packer) | {"quant_method": method}
    group0 = config.get("config_groups", {}).get("group_0", {})
    for key, value in change.items():  # compressed-tensors' scheme keys go to its group
        if key == "weights":
            group0["weights"] |= value
        else:
            config[key] = value
            if key in group0:
                group0[key] = value
    write(tmp_path, packer, config=config)
    with pytest.raises(UnsupportedConfigError, match=match):
        from_pretrained(tmp_path, dtype="float32")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_group_of_16_is_refused_naming_layer_and_group(tmp_path, method):
    write(tmp_path, method, group=16)
    with pytest.raises(
        UnsupportedConfigError,
        match=r"layer 'model\.layers\.0\..*': group of 16 "
        r"inputs.*multiple of 32 dividing in_features \(\d+\).*quantized=False",
    ):
        from_pretrained(tmp_path, dtype="float32")
    assert from_pretrained(tmp_path, dtype="float32", quantized=False) is not None


def test_desc_act_with_reordered_groups_is_refused(tmp_path):
    """desc_act's g_idx in another order than the groups is refused; desc_act with groups in
    order (gptqmodel's static_groups) loads."""
    config = qconfig("gptq", desc_act=True)
    specs = write(tmp_path / "static", "gptq", config=config)
    check(tmp_path / "static", specs, "int4")
    write(tmp_path / "act", "gptq", pack={"shuffle": True}, config=config)
    with pytest.raises(UnsupportedConfigError, match=r"desc_act=True.*cannot permute its input"):
        from_pretrained(tmp_path / "act", dtype="float32")


def _set(name: str, value):
    def change(state):
        state[name].view(-1)[0] = value

    return change


def _truncate(name: str):
    def change(state):
        state[name] = state[name][:, :8].contiguous()

    return change


@pytest.mark.parametrize(
    ("method", "pack", "change", "match"),
    [
        ("awq", {}, lambda state: state.pop("model.layers.0.mlp.up_proj.scales"),
         r"'model\.layers\.0\.mlp\.up_proj' \(awq\) lacks tensor\(s\) "
         r"\['model\.layers\.0\.mlp\.up_proj\.scales'\]; the checkpoint is incomplete"),
        ("awq", {}, _truncate("model.layers.0.mlp.up_proj.scales"),
         r"up_proj': scales is torch.float16 \(2, 8\), expected float \(2, 256\)"),
        ("compressed-tensors", {"zp": "int8"},
         _set("model.layers.0.mlp.gate_proj.weight_zero_point", 20),
         r"gate_proj': a zero point of 20 is outside the 4-bit range -8\.\.7"),
        ("awq", {}, _set("model.layers.0.mlp.down_proj.scales", 60000.0),  # z · s past 65504
         r"down_proj': a minimum -z·s of -\d+ does not fit fp16.*quantized=False"),
    ],
    ids=["missing", "misshaped", "zero point", "minimum"],
)  # fmt: skip
def test_broken_tensors_are_named(tmp_path, method, pack, change, match):
    load_file = pytest.importorskip("safetensors.torch").load_file
    write(tmp_path, method, pack=pack)
    state = load_file(str(tmp_path / "model.safetensors"))
    change(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(tmp_path, dtype="float32")
