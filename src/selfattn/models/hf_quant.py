"""Quantised transformers checkpoints (AWQ, GPTQ, compressed-tensors) loaded as
:class:`~selfattn.nn.QuantizedLinear`, their integers kept, never dequantised.

A checkpoint's ``config.json`` names its method in ``quantization_config.quant_method``; each of
its quantised linear layers ``P`` (``N`` = out_features, ``K`` = in_features, ``G = K / group``
groups of inputs, ``group_size: -1`` or a channel strategy: one group of ``K``) holds packed
int32 words instead of ``P.weight``. In every format ``w = (u - z) · s``, with unsigned codes
``u`` and zero points ``z`` of ``bits`` bits and scales ``s``::

    AWQ ("awq", version "gemm": AutoAWQ's WQLinear_GEMM), 4 bits, zero points:
        P.qweight  int32 (K, N/8)   word c of a row: nibble i is column 8c + AWQ_ORDER[i]
        P.qzeros   int32 (G, N/8)   the same order
        P.scales   fp16  (G, N)
    GPTQ ("gptq": gptqmodel, AutoGPTQ, optimum), 4 or 8 bits:
        P.qweight  int32 (K·bits/32, N)   32/bits inputs a word, the first at bit 0
        P.qzeros   int32 (G, N·bits/32)   32/bits columns a word, the first at bit 0
        P.scales   fp16  (G, N)
        P.g_idx    int32 (K,)             each input's group
        format "gptq" (v1, the default) stores z - 1: gptqmodel writes it by subtracting
        0x11111111 (0x01010101 at 8 bits) from each whole word and reads it back by adding the
        same, so the words are added to (a zero point of 0 borrows from its neighbour);
        "gptq_v2" stores z. sym=true has z = 2^(bits-1) everywhere.
    compressed-tensors ("compressed-tensors", format "pack-quantized": llmcompressor's W4A16 /
    W8A16), 4 or 8 bits, strategy "group" or "channel", symmetric or not:
        P.weight_packed      int32 (N, K·bits/32)   q + 2^(bits-1), element i at bit bits·i
        P.weight_scale       (N, G), the model's float dtype
        P.weight_zero_point  asymmetric only: zp + 2^(bits-1) packed likewise along N, int32
                             (N·bits/32, G) (older versions: int8 (N, G), zp itself)
        P.weight_shape       (2,): N, K
        signed q and zp: u = q + 2^(bits-1), z = zp + 2^(bits-1) (symmetric: zp = 0).

As a :class:`~selfattn.nn.QuantizedLinear` (``selfattn.nn.quant``'s formats)::

    4 bits, zero points   int4       d = s, m = -z·s rounded once to fp16
    4 bits, symmetric     int4_sym   d = s (w = d · (u - 8): exact)
    8 bits, symmetric     int8       codes u - 128, d = s (exact)

``d`` and ``m`` are fp16: AWQ's and GPTQ's scales are, compressed-tensors' bf16 ones are exact in
fp16's normal range and fp32 ones round once. The rounding of ``m`` costs at most half an fp16
ulp of ``z · s``, which is at most ``|w|``'s largest in the group (the codes run from 0 to 15), so
the dequantised weight is within what fp16 arithmetic on ``(u - z) · s`` gives (the packers' own
kernels compute in fp16). A scale or minimum that fp16 cannot hold at its precision, a group that
is not a multiple of 32 dividing ``K``, 8-bit codes with zero points, or inputs reordered into
groups (GPTQ's ``desc_act`` / compressed-tensors' ``actorder`` with a non-trivial ``g_idx``: a
QuantizedLinear cannot permute its input) are refused with the layer named; ``quantized=False``
loads every packed layer dequantised instead (exactly, in fp32, then cast to the model's dtype).

Layers the checkpoint left float (``modules_to_not_convert``, ``ignore``, the LM head,
embeddings) load as usual: a layer is quantised exactly when it holds packed tensors. q/k/v fuse
into a fused ``qkv_proj`` (their buffers' rows joined, as ``cat_rows`` joins them) when all three
share one format and group; a layer's three in different ones are dequantised (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from selfattn._log import log_once
from selfattn.models import hub
from selfattn.nn import quant

__all__ = ["AWQ", "AWQ_ORDER", "GPTQ", "CompressedTensors", "Packing"]

# AutoAWQ's GEMM packing: nibble i of a word holds column 8c + AWQ_ORDER[i] (the order its CUDA
# kernel dequantises in); _AWQ_COLUMNS[j] is the nibble of column j.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_COLUMNS = [AWQ_ORDER.index(j) for j in range(8)]
# gptqmodel's v1 -> v2 conversion adds one to every zero point of a word at once.
_V1_ONES = {4: 0x11111111, 8: 0x01010101}
_FP16_EPS = 2.0**-11  # fp16's rounding: at most this much of |x| in its normal range


class Ints(NamedTuple):
    """One layer's integers, ``w = (u - z) · s``: codes ``u (N, K)`` and zero points ``z (N, G)``
    uint8 (None: the symmetric ``2^(bits-1)``), scales ``s (N, G)`` in the checkpoint's dtype."""

    u: torch.Tensor
    z: torch.Tensor | None
    s: torch.Tensor
    bits: int

    @property
    def group(self) -> int:
        return self.u.shape[1] // self.s.shape[1]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``(N, K)`` in ``dtype``, computed in fp32: ``u - z`` is a small integer and
        ``s`` at most fp32, so each weight rounds at most once before the cast."""
        N, K = self.u.shape
        z = 1 << (self.bits - 1) if self.z is None else self.z.float().unsqueeze(-1)
        w = (self.u.float().view(N, -1, self.group) - z) * self.s.float().unsqueeze(-1)
        return w.view(N, K).to(dtype)


def words(t: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits``-wide fields of int32 words ``(R, C)`` as uint8 ``(R, C · 32 / bits)``, field
    ``i`` of a word at bit ``bits · i`` (read as the words' little-endian bytes)."""
    b = t.contiguous().view(torch.uint8)  # (R, 4C): each word's bytes, the low one first
    if bits == 8:
        return b
    return torch.stack((b & 15, b >> 4), -1).view(t.shape[0], -1)


class Packing:
    """What a quantisation method's checkpoint holds and how its layers become QuantizedLinear
    (``hub.from_pretrained`` calls :meth:`keeps`, :meth:`unpack` and :meth:`swap`). A subclass
    names its tensors (``LEAVES``: the first marks a packed layer; ``OPTIONAL``), reads the
    config's options in ``__init__`` and turns one layer's tensors into :class:`Ints`
    (:meth:`ints`)."""

    METHOD = ""
    LEAVES: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()
    SCALES = ""

    def __init__(self, qconfig: Mapping, config: Mapping, quantized: bool):
        self.qconfig, self.quantized = qconfig, quantized
        file = getattr(config, "file", None)
        self.where = f"{str(file)!r}: " if file is not None else ""

    def refuse(self, key: str, value, why: str) -> hub.UnsupportedConfigError:
        return hub.UnsupportedConfigError(
            f"{self.where}quantization_config {key}={value!r} ({self.METHOD}) is not "
            f"supported: {why}"
        )

    def keeps(self, name: str) -> bool:
        """Whether tensor ``name`` keeps its own float dtype on reading (the scales)."""
        return name.endswith("." + self.SCALES)

    def ints(self, layer: str, t: dict) -> Ints:
        raise NotImplementedError

    # -- the steps of a load -------------------------------------------------------------------
    def unpack(self, state: dict, dtype: torch.dtype) -> None:
        """Each packed layer ``P`` of ``state`` (checkpoint names) -> ``P.qs``, ``P.d``
        (``P.m``): its QuantizedLinear buffers, or with ``quantized=False`` ``P.weight`` in
        ``dtype``; in place, one layer at a time."""
        marker = "." + self.LEAVES[0]
        built = {}
        for layer in [k[: -len(marker)] for k in state if k.endswith(marker)]:
            missing = [f"{layer}.{x}" for x in self.LEAVES if f"{layer}.{x}" not in state]
            if missing:
                raise hub.CheckpointError(
                    f"quantised layer {layer!r} ({self.METHOD}) lacks tensor(s) {missing}; the "
                    "checkpoint is incomplete"
                )
            t = {
                x: state.pop(f"{layer}.{x}")
                for x in self.LEAVES + self.OPTIONAL
                if f"{layer}.{x}" in state
            }
            ints = self.ints(layer, t)
            if not self.quantized:
                state[f"{layer}.weight"] = ints.dense(dtype)
                continue
            built[layer] = new = self.layer(layer, ints, dtype)
            state.update({f"{layer}.{k}": v for k, v in new.state_dict().items()})
        _dequantise_mixed(state, built, dtype)

    def check_group(self, layer: str, group: int, K: int, *, kept: bool = True) -> None:
        """Refuse a group that does not divide ``K`` or, ``kept`` as a QuantizedLinear, is not a
        multiple of 32 (a dequantised layer takes any group that divides)."""
        divides = group > 0 and not K % group
        if divides and not (kept and group % quant.BLOCK):
            return
        fix = "; pass quantized=False to load it dequantised" if divides else ""
        raise hub.UnsupportedConfigError(
            f"{self.where}layer {layer!r}: group of {group} inputs: a QuantizedLinear needs a "
            f"multiple of {quant.BLOCK} dividing in_features ({K}){fix}"
        )

    def layer(self, layer: str, ints: Ints, dtype: torch.dtype) -> quant.QuantizedLinear:
        """The QuantizedLinear of ``ints`` (module docstring's table)."""
        u, z, s, bits = ints
        self.check_group(layer, ints.group, u.shape[1])
        d = _fp16_bits(layer, "scale", s)
        if bits == 8:
            if z is not None:
                raise hub.CheckpointError(
                    f"quantised layer {layer!r} has 8-bit codes with zero points; int8 "
                    "QuantizedLinear codes have none (w = d · q): pass quantized=False"
                )
            q = (u.to(torch.int16) - 128).to(torch.int8)
            return quant.QuantizedLinear.from_codes(q, d, group=ints.group, dtype=dtype)
        m = None if z is None else _fp16_bits(layer, "minimum -z·s", -(z.double() * s.double()))
        return quant.QuantizedLinear.from_codes(u, d, m, group=ints.group, dtype=dtype)

    @staticmethod
    def swap(model: nn.Module, state: dict, dtype: torch.dtype, device) -> None:
        """Each module ``P`` given ``P.qs`` by the family's conversion becomes a QuantizedLinear
        of its shape in ``dtype`` (empty: ``load_state`` then assigns the buffers)."""
        for key in [k for k in state if k.endswith(".qs")]:
            path = key[: -len(".qs")]
            try:
                old = model.get_submodule(path)
            except AttributeError:
                old = None
            if not isinstance(old, nn.Linear):
                raise hub.CheckpointError(
                    f"quantised layer {path!r} (converted name) is not a linear layer of "
                    f"{type(model).__name__}: its family does not load quantised checkpoints "
                    "(the Llama family does); pass quantized=False to load it dequantised"
                )
            qs, d = state[key], state[f"{path}.d"]
            K = qs.shape[1] * (1 if qs.dtype == torch.int8 else 2)
            if (qs.shape[0], K) != (old.out_features, old.in_features):
                raise hub.CheckpointError(
                    f"quantised layer {path!r}: checkpoint ({qs.shape[0]}, {K}) vs model "
                    f"({old.out_features}, {old.in_features})"
                )
            fmt = "int4" if f"{path}.m" in state else "int4_sym"
            fmt = "int8" if qs.dtype == torch.int8 else fmt
            bias = old.bias is not None
            new = quant.QuantizedLinear(K, qs.shape[0], fmt, group=K // d.shape[1], bias=bias,
                                        dtype=dtype, device=device)  # fmt: skip
            model.set_submodule(path, new)


def _fp16_bits(layer: str, what: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as fp16 bits (int16); :class:`CheckpointError` where fp16 cannot hold a value at
    its precision (beyond 65504, or a subnormal that rounds by more than a normal would)."""
    h = x.to(torch.float16)
    off = (h.double() - x.double()).abs() > _FP16_EPS * x.double().abs()
    bad = off | ~torch.isfinite(h)
    if bool(bad.any()):
        value = x[bad][0].item()
        raise hub.CheckpointError(
            f"quantised layer {layer!r}: a {what} of {value:.6g} does not fit fp16, in which "
            "QuantizedLinear keeps scales and minimums (|x| <= 65504 at fp16's precision); pass "
            "quantized=False to load it dequantised"
        )
    return h.view(torch.int16)


def _dequantise_mixed(state: dict, built: dict, dtype: torch.dtype) -> None:
    """A layer's q/k/v fuse into one QuantizedLinear only in one format and group: where they
    differ (or some are float), its quantised ones become float weights."""
    for q in [p for p in built if p.endswith(".q_proj")]:
        trio = [q.removesuffix("q_proj") + n for n in ("q_proj", "k_proj", "v_proj")]
        if not all(p in built or f"{p}.weight" in state for p in trio):
            continue  # not a q/k/v triple: nothing fuses
        kinds = {(built[p].fmt, built[p].group) if p in built else "float" for p in trio}
        if len(kinds) == 1:
            continue
        log_once(
            ("hf-quant-mixed", tuple(sorted(map(str, kinds)))),
            logging.INFO,
            "quantised checkpoint: q/k/v of %s in different formats %s; dequantising them",
            q.removesuffix(".q_proj"),
            sorted(map(str, kinds)),
        )
        for p in [p for p in trio if p in built]:
            for leaf in ("qs", "d", "m"):
                state.pop(f"{p}.{leaf}", None)
            state[f"{p}.weight"] = built.pop(p).dequantize(dtype)


def _misshaped(layer: str, name: str, t: torch.Tensor, want: str) -> hub.CheckpointError:
    return hub.CheckpointError(
        f"quantised layer {layer!r}: {name} is {t.dtype} {tuple(t.shape)}, expected {want}"
    )


def _check_shape(layer: str, name: str, t: torch.Tensor, shape: tuple, dtype=None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise _misshaped(layer, name, t, f"{dtype or 'float'} {shape}")


def _trivial_groups(layer: str, g_idx: torch.Tensor | None, group: int, K: int) -> bool:
    """Whether ``g_idx`` (None: absent) puts input ``i`` in group ``i // group``."""
    if g_idx is None:
        return True
    want = torch.arange(K, device=g_idx.device) // group
    return tuple(g_idx.shape) == (K,) and bool(torch.equal(g_idx.long(), want))


class AWQ(Packing):
    """AutoAWQ's GEMM checkpoints (module docstring)."""

    METHOD = "awq"
    LEAVES = ("qweight", "qzeros", "scales")
    SCALES = "scales"

    def __init__(self, qconfig, config, quantized):
        super().__init__(qconfig, config, quantized)
        version = qconfig.get("version", qconfig.get("format", "gemm"))
        if str(version).lower() != "gemm":
            raise self.refuse(
                "version",
                version,
                "only 'gemm' (AutoAWQ's default, which "
                "transformers and vLLM load) is read; the others order their "
                "words differently: export it as GEMM",
            )
        bits = qconfig.get("bits", qconfig.get("w_bit", 4))
        if bits != 4:
            raise self.refuse("bits", bits, "AWQ's GEMM layout is 4-bit")
        if not qconfig.get("zero_point", True):
            raise self.refuse("zero_point", False, "AutoAWQ's GEMM layers hold zero points")
        self.group_size = qconfig.get("group_size", qconfig.get("q_group_size", 128))

    def ints(self, layer, t):
        qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise _misshaped(layer, "qweight", qweight, "int32 (in_features, out_features / 8)")
        K, N = qweight.shape[0], qweight.shape[1] * 8
        group = K if self.group_size == -1 else self.group_size
        self.check_group(layer, group, K, kept=False)
        _check_shape(layer, "qzeros", qzeros, (K // group, N // 8), torch.int32)
        _check_shape(layer, "scales", scales, (K // group, N))

        def unorder(w):  # (R, N/8) words -> (R, N) fields in column order
            return words(w, 4).view(w.shape[0], -1, 8)[..., _AWQ_COLUMNS].reshape(w.shape[0], N)

        return Ints(unorder(qweight).T.contiguous(), unorder(qzeros).T, scales.T, 4)


class GPTQ(Packing):
    """GPTQ checkpoints (gptqmodel, AutoGPTQ, optimum; module docstring)."""

    METHOD = "gptq"
    LEAVES = ("qweight", "qzeros", "scales")
    OPTIONAL = ("g_idx",)
    SCALES = "scales"

    def __init__(self, qconfig, config, quantized):
        super().__init__(qconfig, config, quantized)
        self.bits = qconfig.get("bits", 4)
        if self.bits not in (4, 8):
            raise self.refuse("bits", self.bits, "4- and 8-bit GPTQ are read")
        key = "format" if "format" in qconfig else "checkpoint_format"
        self.v1 = qconfig.get(key, "gptq") == "gptq"
        if qconfig.get(key, "gptq") not in ("gptq", "gptq_v2"):
            raise self.refuse(
                key,
                qconfig[key],
                "the 'gptq' (v1) and 'gptq_v2' layouts are "
                "read; others (marlin, bitblas, ...) repack the words",
            )
        if str(qconfig.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise self.refuse("pack_dtype", qconfig["pack_dtype"], "int32 words are read")
        self.sym = qconfig.get("sym", True)
        if self.bits == 8 and not self.sym and quantized:
            raise self.refuse(
                "sym",
                False,
                "8-bit codes with zero points have no "
                "QuantizedLinear format (int8 is w = d · q): pass quantized=False",
            )
        self.group_size = qconfig.get("group_size", 128)
        self.desc_act = qconfig.get("desc_act", False)

    def ints(self, layer, t):
        qweight, qzeros, scales, bits = t["qweight"], t["qzeros"], t["scales"], self.bits
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise _misshaped(
                layer, "qweight", qweight, f"int32 (in_features · {bits} / 32, out_features)"
            )
        K, N = qweight.shape[0] * 32 // bits, qweight.shape[1]
        group = K if self.group_size == -1 else self.group_size
        self.check_group(layer, group, K, kept=False)
        _check_shape(layer, "qzeros", qzeros, (K // group, N * bits // 32), torch.int32)
        _check_shape(layer, "scales", scales, (K // group, N))
        g_idx = t.get("g_idx")
        if not _trivial_groups(layer, g_idx, group, K) or (g_idx is None and self.desc_act):
            raise self.refuse(
                "desc_act",
                self.desc_act,
                f"layer {layer!r} takes its inputs in another order "
                "than its groups (g_idx is not i // group_size): a QuantizedLinear cannot "
                "permute its input; pass quantized=False to load it dequantised, or quantise "
                "with desc_act=False",
            )
        if self.v1:  # gptqmodel's v1 -> v2: one added to each word's zero points at once
            wide = (qzeros.long() + _V1_ONES[bits]) & 0xFFFFFFFF
            qzeros = torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)
        z = words(qzeros, bits).T  # (G, N) -> (N, G)
        if self.sym:
            mid = 1 << (bits - 1)
            if bool((z != mid).any()):
                raise hub.CheckpointError(
                    f"quantised layer {layer!r}: sym=true but a zero point is "
                    f"{int(z[z != mid][0])}, not {mid}; the config or the packing is wrong"
                )
            z = None
        return Ints(words(qweight.T, bits), z, scales.T, bits)


class CompressedTensors(Packing):
    """compressed-tensors' ``pack-quantized`` checkpoints (llmcompressor; module docstring)."""

    METHOD = "compressed-tensors"
    LEAVES = ("weight_packed", "weight_scale", "weight_shape")
    OPTIONAL = ("weight_zero_point", "weight_g_idx")
    SCALES = "weight_scale"

    def __init__(self, qconfig, config, quantized):
        super().__init__(qconfig, config, quantized)
        status = qconfig.get("quantization_status", "compressed")
        if status != "compressed":
            raise self.refuse(
                "quantization_status", status, "only compressed checkpoints hold packed integers"
            )
        for key in ("sparsity_config", "transform_config"):
            if qconfig.get(key):
                raise self.refuse(key, qconfig[key], "sparse or transformed weights are not read")
        groups = qconfig.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise self.refuse("config_groups", groups, "a compressed checkpoint lists its groups")
        self.bits, self.groups = set(), set()
        for name, g in groups.items():
            fmt = g.get("format") or qconfig.get("format")
            if fmt != "pack-quantized":
                raise self.refuse(
                    f"config_groups.{name}.format",
                    fmt,
                    "'pack-quantized' (int4/int8 weights in int32 words) is read",
                )
            if g.get("input_activations") or g.get("output_activations"):
                raise self.refuse(
                    f"config_groups.{name}.input_activations",
                    g.get("input_activations") or g.get("output_activations"),
                    "quantised activations are not run (weight-only schemes "
                    "such as W4A16 and W8A16 are read)",
                )
            w = g.get("weights") or {}
            for key, ok in (
                ("type", ("int",)),
                ("num_bits", (4, 8)),
                ("strategy", ("group", "channel")),
            ):
                if w.get(key) not in ok:
                    raise self.refuse(
                        f"config_groups.{name}.weights.{key}", w.get(key), f"{list(ok)} are read"
                    )
            if w.get("num_bits") == 8 and not w.get("symmetric", True) and quantized:
                raise self.refuse(
                    f"config_groups.{name}.weights.symmetric",
                    False,
                    "8-bit codes with zero points have no QuantizedLinear format "
                    "(int8 is w = d · q): pass quantized=False",
                )
            self.bits.add(w["num_bits"])
            if w["strategy"] == "group":
                self.groups.add(w.get("group_size"))

    def ints(self, layer, t):
        packed, s, shape = t["weight_packed"], t["weight_scale"], t["weight_shape"]
        if shape.numel() != 2 or packed.dtype != torch.int32 or packed.dim() != 2:
            raise hub.CheckpointError(
                f"quantised layer {layer!r}: weight_packed {packed.dtype} "
                f"{tuple(packed.shape)} with weight_shape {shape.tolist()}: expected int32 "
                "(N, K·bits/32) and [N, K]"
            )
        N, K = (int(v) for v in shape)
        bits = next((b for b in self.bits if packed.shape == (N, K * b // 32)), None)
        if bits is None or K % 32:
            widths = [f"{K} · {b} / 32" for b in sorted(self.bits)]
            raise _misshaped(layer, "weight_packed", packed, f"int32 ({N}, {' or '.join(widths)})")
        G = s.shape[1] if s.dim() == 2 and s.shape[0] == N else 0
        groups = {K, *self.groups}  # K: the channel strategy's one group
        group = next((g for g in groups if isinstance(g, int) and g > 0 and G * g == K), None)
        if group is None:
            raise _misshaped(
                layer,
                "weight_scale",
                s,
                f"({N}, {K} / group) for a group of {sorted(groups, key=str)}",
            )
        if not _trivial_groups(layer, t.get("weight_g_idx"), group, K):
            raise self.refuse(
                "actorder",
                "group",
                f"layer {layer!r} takes its inputs in another order than "
                "its groups (weight_g_idx is not i // group_size): a QuantizedLinear cannot "
                "permute its input; pass quantized=False to load it dequantised",
            )
        z, mid = t.get("weight_zero_point"), 1 << (bits - 1)
        if z is not None and z.dtype == torch.int32:  # packed along N
            _check_shape(layer, "weight_zero_point", z, (-(-N * bits // 32), K // group))
            z = words(z.T, bits)[:, :N].T
        elif z is not None:  # unpacked signed zero points (older compressed-tensors)
            _check_shape(layer, "weight_zero_point", z, (N, K // group))
            z = z.to(torch.int16) + mid
            if bool(((z < 0) | (z >= 2 * mid)).any()):
                bad = int(z[(z < 0) | (z >= 2 * mid)][0]) - mid
                raise hub.CheckpointError(
                    f"quantised layer {layer!r}: a zero point of {bad} is outside the "
                    f"{bits}-bit range {-mid}..{mid - 1}"
                )
            z = z.to(torch.uint8)
        return Ints(words(packed, bits)[:, :K], z, s, bits)


hub.register_quantization("awq", AWQ)
hub.register_quantization("gptq", GPTQ)
hub.register_quantization("compressed-tensors", CompressedTensors)
