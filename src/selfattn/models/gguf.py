"""GGUF files (llama.cpp's single-file checkpoints) in, transformers folders out.

``from_pretrained("model.gguf")`` routes here (:func:`load_gguf`): the file's metadata becomes a
transformers-style ``config.json`` dict (:func:`gguf_config`; architectures llama, llama with a
sliding window (Mistral), qwen2, qwen3, gemma2, gemma3, phi3), so the families' own
``from_config`` builds the model on the meta device; llama.cpp's tensor names become
transformers' and the family's ``convert_hf_state_dict`` + :func:`~selfattn.models.hub.load_state`
assign them. :func:`save_pretrained` writes the same weights (and, through
:mod:`selfattn.models.gguf_tokenizer`, the tokenizer) as a transformers folder.

The header is parsed here rather than by ``gguf.GGUFReader``: every count and length is checked
against the bytes left in the file before anything is allocated from it, so a truncated or
corrupt file raises :class:`GGUFError` naming the field, never a numpy error, a hang over a
corrupt array length or a huge allocation (``GGUFReader`` also builds a numpy array per
vocabulary entry: seconds for a 50k-token file). ``gguf`` (llama.cpp's Python package) supplies
the block sizes and the dequantisation of the quantised types.

Memory: one layer at a time, each tensor read with ``readinto`` into an anonymous memory map of
its own (a map of the file would count its pages and the loaded weights both), converted, cast
or handed to its quantised module, and freed before the next layer: the peak is the loaded
weights plus one layer in flight.

Layout facts (llama.cpp's ``convert_hf_to_gguf.py``): a tensor's dims are stored innermost
first (``ne0`` = columns), so PyTorch's shape is the reverse; the ``llama`` architecture's Q/K
rows are permuted per head from RoPE's half-split layout to interleaved pairs (undone here, on
whole rows, so it works on quantised blocks too; qwen2/qwen3/gemma/phi3 keep transformers'
layout); Gemma's RMSNorm weights are stored as ``1 + w``; Phi-3's ``ffn_up`` holds the gate rows,
then the up rows.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import math
import mmap
import os
import re
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfattn._log import log_once
from selfattn._optional import require
from selfattn.models import gguf_tokenizer, hub
from selfattn.models.tokenizer import Tokenizer
from selfattn.models.tokenizer import register_format as register_tokenizer_format
from selfattn.nn import quant

__all__ = [
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "gguf_config",
    "gguf_source",
    "is_gguf",
    "load_gguf",
    "open_gguf",
    "read_metadata",
    "save_pretrained",
]

log = logging.getLogger("selfattn")

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit lengths and is not read
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays this deep at most
_SMALL_ARRAY = 64  # arrays up to this long are always read (open_gguf's arrays=False)

# GGUF metadata value types: id -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_VALUE_TYPES = {**{k: f"{v}" for k, v in _SCALARS.items()}, _STRING: "string", _ARRAY: "array"}

# GGML tensor types read directly; types gguf.quants dequantises; types kept quantised in
# QuantizedLinear / QuantizedEmbedding (blocks of 32 along the input dim).
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F64": torch.float64}  # fmt: skip
_DEQUANTISED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
KEPT_QUANTISED = ("Q8_0", "Q4_0", "Q4_1")
SUPPORTED_TYPES = (*_FLOAT_TYPES, *_DEQUANTISED)
_CHUNK_BYTES = 16 << 20  # fp32 output per dequantisation step: bounds numpy's temporaries


class GGUFError(hub.CheckpointError):
    """A GGUF file that cannot be loaded: truncated or corrupt, a version, architecture or
    tensor type we do not read, or metadata that disagrees with its tensors."""


# -- the header -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ``shape`` in PyTorch order (rows, cols), ``offset`` the absolute
    byte offset of its data, ``nbytes`` its size in the file."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def quantised(self) -> bool:
        return self.type_name not in _FLOAT_TYPES


@dataclass
class GGUFFile:
    """A validated GGUF header: ``metadata`` (Python values; arrays as lists) and ``tensors``
    (name -> :class:`TensorInfo`, in file order). Tensor data is read by :meth:`raw`."""

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    size: int

    def field(self, key: str, kinds: tuple[type, ...] = (int,), default=None):
        """Metadata ``key`` checked to be one of ``kinds`` (bool is not an int here), else
        ``default`` when absent."""
        value = self.metadata.get(key, default)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if value is not default and not ok:
            raise GGUFError(
                f"{str(self.path)!r}: metadata {key}={_preview(value)} is a "
                f"{type(value).__name__}; expected {' or '.join(k.__name__ for k in kinds)}"
            )
        return value

    def require(self, key: str, kinds: tuple[type, ...] = (int,)):
        if key not in self.metadata:
            raise GGUFError(f"{str(self.path)!r}: metadata has no {key!r}, a required key")
        return self.field(key, kinds)

    def raw(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s bytes as a uint8 tensor of its own, read with ``readinto`` into an
        anonymous memory map: freed, it goes back to the system at once (bytes a quantised
        module or a cast copies from would otherwise stay in the heap between the modules'
        buffers, raising the peak by a good part of the file)."""
        info = self.tensors[name]
        area = mmap.mmap(-1, max(info.nbytes, 1))
        buf = torch.frombuffer(area, dtype=torch.uint8, count=info.nbytes)  # keeps `area` alive
        view = memoryview(area)[: info.nbytes]
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(info.offset)
            done = 0
            while done < info.nbytes:
                n = fh.readinto(view[done:])
                if not n:
                    raise GGUFError(
                        f"{str(self.path)!r} ends inside tensor {name!r} (byte "
                        f"{info.offset + done} of {info.offset + info.nbytes}): the file was "
                        "truncated after it was opened"
                    )
                done += n
        view.release()
        return buf


@dataclass(frozen=True)
class SkippedArray:
    """A long metadata array ``open_gguf(..., arrays=False)`` checked but did not read (the
    tokenizer's vocabulary and merges, which a model load does not need): its length only."""

    length: int

    def __len__(self) -> int:
        return self.length


def _preview(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked reads from the header bytes: each length is checked against what is left
    before anything is taken or allocated from it."""

    def __init__(self, buf, path: Path, arrays: bool = True):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path
        self.arrays = arrays

    def truncated(self, n: int, what: str) -> GGUFError:
        return GGUFError(
            f"{str(self.path)!r} is truncated or corrupt: {what} needs {n} bytes at offset "
            f"{self.pos}, but the file ends at {self.size}; download or convert it again"
        )

    def take(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        if n > self.size - self.pos:
            raise self.truncated(n, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value if len(value) > 1 else value[0]

    def string(self, what: str, strict: bool = False) -> str:
        n = self.take("Q", f"the length of {what}")
        if n > self.size - self.pos:
            raise self.truncated(n, f"{what} (a string of {n} bytes)")
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                raise GGUFError(f"{str(self.path)!r}: {what} is not UTF-8: {data[:40]!r}") from None
            return data.decode("utf-8", "surrogateescape")  # token bytes survive a round trip

    def strings(self, n: int, what: str, skip: bool):
        """An array of ``n`` strings (a vocabulary: tens of thousands), or with ``skip`` only its
        lengths walked: one tight loop with the checks of :meth:`string`, messages made only
        for an error."""
        buf, pos, size = self.buf, self.pos, self.size
        unpack, out = _U64.unpack_from, []
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                raise self.truncated(8, f"the length of {what}[{i}]")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                raise self.truncated(length, f"{what}[{i}] (a string of {length} bytes)")
            if not skip:
                data = bytes(buf[pos : pos + length])
                try:
                    out.append(data.decode("utf-8"))
                except UnicodeDecodeError:  # token bytes survive a round trip
                    out.append(data.decode("utf-8", "surrogateescape"))
            pos += length
        self.pos = pos
        return SkippedArray(n) if skip else out

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise GGUFError(
                f"{str(self.path)!r}: {what} has value type {kind}, not a GGUF type "
                f"({sorted(_VALUE_TYPES)}); the file is corrupt"
            )
        item, n = self.take("IQ", f"the header of array {what}")
        skip = not self.arrays and n > _SMALL_ARRAY
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            if n * size > self.size - self.pos:
                raise self.truncated(n * size, f"array {what} ({n} items)")
            values = () if skip else struct.unpack_from(f"<{n}{_SCALARS[item]}", self.buf, self.pos)
            self.pos += n * size
            return SkippedArray(n) if skip else list(values)
        if item in (_STRING, _ARRAY) and n * 8 > self.size - self.pos:  # 8 bytes an item at least
            raise self.truncated(n * 8, f"array {what} ({n} items)")
        if item == _STRING:
            return self.strings(n, what, skip)
        if depth >= _MAX_NESTING or item not in (_STRING, _ARRAY):
            raise GGUFError(
                f"{str(self.path)!r}: array {what} has item type {item} (nesting {depth}); the "
                "file is corrupt"
            )
        return [self.value(item, f"{what}[{i}]", depth + 1) for i in range(n)]


def is_gguf(path) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == MAGIC
    except (OSError, TypeError):
        return False


@functools.cache
def _ggml():
    """``{type id: (name, block size, bytes per block)}`` from llama.cpp's gguf package."""
    gguf = require("gguf", purpose="loading a GGUF file")
    return {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGML_QUANT_SIZES}


def open_gguf(path, *, arrays: bool = True) -> GGUFFile:
    """Parse and validate the header of the GGUF file ``path`` (nothing of the tensor data is
    read). ``arrays=False`` leaves metadata arrays longer than 64 items unread
    (:class:`SkippedArray`, their length), after the same checks. Raises :class:`GGUFError`
    naming the field for a file that is not GGUF, a version
    other than 2 or 3, truncation anywhere, an unknown tensor type, or tensor data that
    overlaps or runs past the end of the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size < 24:
            head = fh.read(4)
            if head != MAGIC:
                raise GGUFError(f"{str(path)!r} is not a GGUF file: it starts with {head!r}")
            raise GGUFError(
                f"{str(path)!r} is truncated: {size} bytes, shorter than a GGUF header (24)"
            )
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            view = memoryview(buf)
            try:
                return _parse_header(_Cursor(view, path, arrays), path, size)
            finally:
                view.release()


def _parse_header(c: _Cursor, path: Path, size: int) -> GGUFFile:
    where = f"{str(path)!r}"
    magic = bytes(c.buf[:4])
    if magic != MAGIC:
        raise GGUFError(f"{where} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    c.pos = 4
    version = c.take("I", "the version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFError(
            f"{where} is GGUF version {version}{endian}; versions {list(VERSIONS)} are read: "
            "convert it again with a current llama.cpp"
        )
    n_tensors, n_kv = c.take("QQ", "the tensor and metadata counts")
    # the smallest key-value pair: 8 (key length) + 4 (type) + 1 (a uint8 value); the smallest
    # tensor info: 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset)
    for count, what, least in ((n_kv, "metadata count", 13), (n_tensors, "tensor count", 24)):
        if count * least > size - c.pos:
            raise GGUFError(
                f"{where}: header {what} {count} is impossible in a file of {size} bytes; the "
                "file is corrupt"
            )
    metadata = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}", strict=True)
        if key in metadata:
            raise GGUFError(f"{where}: metadata key {key!r} appears twice; the file is corrupt")
        kind = c.take("I", f"the type of metadata {key!r}")
        metadata[key] = c.value(kind, f"metadata {key!r}")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(
            f"{where}: metadata general.alignment={alignment!r}; it must be a power of two"
        )
    ggml = _ggml()
    raw = []
    for i in range(n_tensors):
        name = c.string(f"the name of tensor #{i}", strict=True)
        n_dims = c.take("I", f"the dims count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{where}: tensor {name!r} has {n_dims} dims; 1 to {MAX_DIMS} allowed")
        dims = c.take(f"{n_dims}Q", f"the dims of tensor {name!r}")
        dims = (dims,) if n_dims == 1 else dims
        kind, offset = c.take("IQ", f"the type and offset of tensor {name!r}")
        raw.append((name, dims, kind, offset))
    data_offset = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, kind, offset in raw:
        if name in tensors:
            raise GGUFError(f"{where}: tensor {name!r} appears twice; the file is corrupt")
        if kind not in ggml:
            raise GGUFError(
                f"{where}: tensor {name!r} has GGML type {kind}, which llama.cpp's gguf package "
                f"does not know; supported: {list(SUPPORTED_TYPES)}"
            )
        type_name, block, block_bytes = ggml[kind]
        if any(d < 1 for d in dims) or dims[0] % block:
            raise GGUFError(
                f"{where}: tensor {name!r} ({type_name}) has dims {list(dims)}; each must be "
                f"positive and the first a multiple of the type's block of {block}"
            )
        nbytes = math.prod(dims) // block * block_bytes
        start = data_offset + offset
        if offset % alignment or start + nbytes > size:
            raise GGUFError(
                f"{where}: tensor {name!r} data at offset {offset} (+{nbytes} bytes, file "
                f"data from byte {data_offset}) "
                + (
                    f"is not aligned to {alignment}"
                    if offset % alignment
                    else f"runs past the end of the file ({size} bytes): it is truncated"
                )
            )
        tensors[name] = TensorInfo(name, kind, type_name, tuple(reversed(dims)), start, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise GGUFError(f"{where}: the data of tensors {a!r} and {b!r} overlap; corrupt file")
    return GGUFFile(path, version, metadata, tensors, alignment, data_offset, size)


def gguf_source(path_or_repo_id) -> Path | None:
    """The GGUF file ``from_pretrained`` loads for ``path_or_repo_id``, or None for a folder
    checkpoint or a Hub id: a file starting with the GGUF magic or named ``*.gguf`` (one that
    is not GGUF fails in :func:`open_gguf`, naming its first bytes), or a folder without
    ``config.json`` holding exactly one ``*.gguf``. A ``*.gguf`` path that does not exist is
    a missing file, never a Hub id."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        return None
    path = Path(path_or_repo_id)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or is_gguf(path) else None
    if path.is_dir():
        if (path / "config.json").exists():
            return None
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(found) > 1:
            raise GGUFError(
                f"{str(path)!r} holds several GGUF files {[p.name for p in found]} and no "
                "config.json; pass the path of the one to load"
            )
        return found[0] if found else None
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    return None


def read_metadata(path) -> dict:
    """The metadata of the GGUF file ``path`` as a dict of Python values (str, int, float, bool;
    arrays as lists), after the same validation as :func:`open_gguf`."""
    return open_gguf(path).metadata


# -- metadata -> config.json ----------------------------------------------------------------------

# general.architecture -> (transformers model_type, architectures entry)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_GEMMA = ("gemma2", "gemma3")
# llama.cpp's Gemma-3: every 6th layer global, the others windowed with their own RoPE base
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10000.0
# Architectures whose converter permutes the Q/K rows for llama.cpp's interleaved RoPE.
_PERMUTED = ("llama",)


def _arch(f: GGUFFile) -> str:
    arch = f.require("general.architecture", (str,))
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"{str(f.path)!r}: general.architecture={arch!r} is not supported; supported: "
            f"{sorted(_ARCHITECTURES)}"
        )
    return arch


def _token_ids(f: GGUFFile) -> dict:
    """bos/eos/pad ids; the end-of-turn and end-of-message ids join ``eos_token_id`` (a list
    then), so generation stops at them."""
    # pad always present (None: none), so a config class's own default never stands in
    ids = {"pad_token_id": f.field("tokenizer.ggml.padding_token_id")}
    bos = f.field("tokenizer.ggml.bos_token_id")
    if bos is not None:
        ids["bos_token_id"] = bos
    eos = [f.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(e for e in eos if e is not None))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def _rope_scaling(f: GGUFFile, arch: str, max_pos: int) -> dict | None:
    kind = f.field(f"{arch}.rope.scaling.type", (str,), "none")
    factor = f.field(f"{arch}.rope.scaling.factor", (float, int))
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = f.field(f"{arch}.rope.scaling.original_context_length", default=max_pos)
        scaling = {"rope_type": "yarn", "factor": float(factor or max_pos / orig),
                   "original_max_position_embeddings": orig}  # fmt: skip
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = f.field(f"{arch}.rope.scaling.{key}", (float, int))
            if value is not None:
                scaling[hf] = float(value)
        return scaling
    raise GGUFError(
        f"{str(f.path)!r}: metadata {arch}.rope.scaling.type={kind!r} is not supported; "
        "supported: 'none', 'linear', 'yarn'"
    )


def gguf_config(f: GGUFFile) -> dict:
    """A transformers-style ``config.json`` dict from the file's metadata, checked against its
    tensors (layer count, embedding and vocabulary sizes); :class:`GGUFError` names the key."""
    arch = _arch(f)
    where = str(f.path)
    model_type, cls_name = _ARCHITECTURES[arch]

    def key(name, kinds=(int,), default=None, required=False):
        full = f"{arch}.{name}"
        value = f.require(full, kinds) if required else f.field(full, kinds, default)
        if kinds == (int,) and value is not None and value < 1:
            raise GGUFError(f"{where!r}: metadata {full}={value}; it must be a positive count")
        return value

    n_layers = key("block_count", required=True)
    d = key("embedding_length", required=True)
    n_heads = key("attention.head_count", required=True)
    n_kv = key("attention.head_count_kv", (int, list), n_heads)
    if isinstance(n_kv, list):  # per layer: one value for every layer is all we build
        if len(set(n_kv)) != 1:
            raise GGUFError(
                f"{where!r}: metadata {arch}.attention.head_count_kv={_preview(n_kv)} varies by "
                "layer; one value for every layer is supported"
            )
        n_kv = n_kv[0]
    head_dim = key("attention.key_length", default=d // n_heads if n_heads else 0)
    value_dim = key("attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise GGUFError(
            f"{where!r}: metadata {arch}.attention.value_length={value_dim} differs from "
            f"key_length={head_dim}; equal key and value head sizes are supported"
        )
    max_pos = key("context_length", default=2048)
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{where!r} has no tensor 'token_embd.weight' (the token embedding)")
    if len(embd.shape) != 2 or embd.shape[1] != d:
        raise GGUFError(
            f"{where!r}: tensor token_embd.weight has shape {embd.shape} but metadata "
            f"{arch}.embedding_length={d}; expected (vocab, {d})"
        )
    vocab = embd.shape[0]
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, SkippedArray)) and len(tokens) > vocab:
        raise GGUFError(
            f"{where!r}: metadata tokenizer.ggml.tokens lists {len(tokens)} tokens but "
            f"token_embd.weight has {vocab} rows"
        )
    layers = {int(m[1]) for n in f.tensors if (m := re.match(r"blk\.(\d+)\.", n))}
    if layers != set(range(n_layers)):
        found = f"{min(layers)}..{max(layers)} ({len(layers)} layers)" if layers else "none"
        raise GGUFError(
            f"{where!r}: metadata {arch}.block_count={n_layers} but the file's blk.N tensors "
            f"cover layers {found}; expected 0..{n_layers - 1}"
        )
    config = {
        "architectures": [cls_name],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": d,
        "num_hidden_layers": n_layers,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", (float,), 1e-6)),
        "rope_theta": float(key("rope.freq_base", (float, int), 10000.0)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
        **_token_ids(f),
    }
    rotary = key("rope.dimension_count", default=head_dim)
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    # per-dimension divisors in the file stand for its scaling whole (llama.cpp reads them so)
    scaling = _rope_factors(f, config) or _rope_scaling(f, arch, max_pos)
    if scaling is not None:
        config["rope_scaling"] = scaling
    window = key("attention.sliding_window")
    if arch == "llama" and window:
        config.update(model_type="mistral", architectures=["MistralForCausalLM"],
                      sliding_window=window)  # fmt: skip
    if arch == "phi3":  # every layer windowed where the file says so, as transformers' Phi-3
        config["sliding_window"] = window or None
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if arch in _GEMMA:
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            # llama.cpp scales scores by 1/sqrt(head_dim) (the released Gemma-2/3 but the 27B)
            query_pre_attn_scalar=head_dim,
            sliding_window=window or 4096,
        )
        if arch == "gemma2":
            config["attn_logit_softcapping"] = key("attn_logit_softcapping", (float, int))
            config["final_logit_softcapping"] = key("final_logit_softcapping", (float, int))
            config["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
            ]
        else:
            pattern = key("attention.sliding_window_pattern", default=_GEMMA3_PATTERN)
            config["rope_local_base_freq"] = float(
                key("rope.freq_base_swa", (float, int), _GEMMA3_LOCAL_BASE)
            )
            config["layer_types"] = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(n_layers)
            ]
    name = f.field("general.name", (str,))
    if name:
        config["_name_or_path"] = name
    config["torch_dtype"] = "float32"
    return config


# Tensors of per-dimension RoPE divisors, read into the config rather than the model.
_ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def _rope_factors(f: GGUFFile, config: Mapping) -> dict | None:
    """transformers' ``rope_scaling`` for per-dimension RoPE divisors, or None without them.

    llama.cpp divides each rotated pair's frequency by ``rope_freqs[i]`` (what its converter
    computes from Llama-3.1's ``llama3`` scaling) or, for Phi-3's LongRoPE, by
    ``rope_factors_short`` / ``rope_factors_long`` by context length. Both are LongRoPE's
    ``inv_freq / factor``: one list for both lengths and no attention factor for ``rope_freqs``;
    the file's own lists, original context and attention factor for Phi-3."""
    present = {n.split(".")[0]: n for n in _ROPE_FACTORS if n in f.tensors}
    if not present:
        return None
    where, arch = str(f.path), f.metadata["general.architecture"]
    pairs = int(config["head_dim"] * config.get("partial_rotary_factor", 1.0)) // 2

    def factors(name: str) -> list[float]:
        info = f.tensors[name]
        if info.type_name != "F32" or info.shape != (pairs,):
            raise GGUFError(
                f"{where!r}: {name} is {info.type_name} {list(info.shape)}; per-dimension RoPE "
                f"factors are F32 [{pairs}] (rotary dims / 2 of {arch}.rope.dimension_count)"
            )
        values = f.raw(name).view(torch.float32).tolist()
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise GGUFError(f"{where!r}: {name} holds {bad[:4]}; RoPE factors must be > 0")
        return values

    if "rope_freqs" in present:
        one = factors(present["rope_freqs"])
        return {
            "rope_type": "longrope",
            "short_factor": one,
            "long_factor": one,
            "original_max_position_embeddings": config["max_position_embeddings"],
            "attention_factor": 1.0,
        }
    if set(present) != {"rope_factors_short", "rope_factors_long"}:
        raise GGUFError(
            f"{where!r} holds {sorted(present.values())}; LongRoPE needs both "
            "rope_factors_short and rope_factors_long"
        )
    original = f.field(f"{arch}.rope.scaling.original_context_length", (int,))
    attn = f.field(f"{arch}.rope.scaling.attn_factor", (float, int))
    scaling = {
        "rope_type": "longrope",
        "short_factor": factors(present["rope_factors_short"]),
        "long_factor": factors(present["rope_factors_long"]),
        "original_max_position_embeddings": original or config["max_position_embeddings"],
    }
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    return scaling


# -- tensors --------------------------------------------------------------------------------------

# llama.cpp's names inside blk.N -> transformers' inside model.layers.N (leaf .weight/.bias kept)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v
}
# Gemma-2/3's sandwich norms: ffn_norm is the norm before the MLP there
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: ffn_up holds the gate rows, then the up rows
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class _Entry:
    """One GGUF tensor's place in a transformers checkpoint: its name there and how its rows
    are read back (``heads``: the Q/K permutation's head count; ``minus_one``: Gemma's norms)."""

    info: TensorInfo
    hf_name: str
    heads: int | None = None
    minus_one: bool = False


def _plan(f: GGUFFile, config: Mapping) -> list[_Entry]:
    """Every tensor of ``f`` with its transformers name; a name no rule knows is an error naming
    it (never silently dropped)."""
    arch = f.metadata["general.architecture"]
    names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
    names = _PHI3_LAYER_NAMES if arch == "phi3" else names
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    plan = []
    for info in f.tensors.values():
        if info.name in _ROPE_FACTORS:  # read into the config (_rope_factors)
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", info.name)
        if m:
            hf = names.get(m[2])
            hf = hf and f"model.layers.{m[1]}.{hf}.{m[3]}"
        else:
            hf = _TOP_NAMES.get(info.name)
        if hf is None:
            raise GGUFError(
                f"{str(f.path)!r}: tensor {info.name!r} ({arch}) has no place in the model; "
                f"known names: {sorted(_TOP_NAMES)} and blk.N.{{{', '.join(sorted(names))}}}"
            )
        if info.type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{str(f.path)!r}: tensor {info.name!r} has type {info.type_name}; supported: "
                f"{list(SUPPORTED_TYPES)}"
            )
        permute = heads.get(m[2]) if m and arch in _PERMUTED else None
        gemma_norm = arch in _GEMMA and info.name.endswith("norm.weight")
        plan.append(_Entry(info, hf, permute, gemma_norm))
    return plan


def _check_shapes(f: GGUFFile, config: Mapping) -> None:
    """Every tensor's shape against the metadata, and every layer's required tensors present,
    before any data is read; errors name the tensor, both shapes and the metadata keys."""
    arch = f.metadata["general.architecture"]
    c = config
    d, ff, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    why_q = f"{arch}.attention.head_count · key_length"
    why_kv = f"{arch}.attention.head_count_kv · key_length"
    why_d, why_ff = f"{arch}.embedding_length", f"{arch}.feed_forward_length"
    layer = {  # name -> (shape, the metadata it follows)
        "attn_norm.weight": ((d,), why_d),
        "attn_q.weight": ((q, d), why_q),
        "attn_k.weight": ((kv, d), why_kv),
        "attn_v.weight": ((kv, d), why_kv),
        "attn_output.weight": ((d, q), why_q),
        "ffn_norm.weight": ((d,), why_d),
        "ffn_gate.weight": ((ff, d), why_ff),
        "ffn_up.weight": ((ff, d), why_ff),
        "ffn_down.weight": ((d, ff), why_ff),
    }
    extra = {
        "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
        "gemma2": ("post_attention_norm.weight", "post_ffw_norm.weight"),
        "gemma3": ("post_attention_norm.weight", "post_ffw_norm.weight", "attn_q_norm.weight",
                   "attn_k_norm.weight"),
    }.get(arch, ())  # fmt: skip
    optional = {
        "attn_q.bias": ((q,), why_q),
        "attn_k.bias": ((kv,), why_kv),
        "attn_v.bias": ((kv,), why_kv),
        "attn_q_norm.weight": ((hd,), f"{arch}.attention.key_length"),
        "attn_k_norm.weight": ((hd,), f"{arch}.attention.key_length"),
        "post_attention_norm.weight": ((d,), why_d),
        "post_ffw_norm.weight": ((d,), why_d),
    }
    if arch == "phi3":  # fused q/k/v and gate/up
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            del layer[name]
        layer["attn_qkv.weight"] = ((q + 2 * kv, d), f"{why_q} + 2 · {why_kv}")
        layer["ffn_up.weight"] = ((2 * ff, d), f"2 · {why_ff}")
    top = {"output_norm.weight": ((d,), why_d), "output.weight": ((c["vocab_size"], d), why_d)}
    for name, info in f.tensors.items():
        m = re.fullmatch(r"blk\.\d+\.(.+)", name)
        want = (layer | optional).get(m[1]) if m else top.get(name)
        if want is not None and info.shape != want[0]:
            raise GGUFError(
                f"{str(f.path)!r}: tensor {name!r} has shape {info.shape} but the metadata "
                f"({want[1]}) makes it {want[0]}; the file is inconsistent"
            )
    needed = [*layer, *extra]
    missing = [f"blk.{i}.{n}" for i in range(c["num_hidden_layers"]) for n in needed]
    missing = [n for n in missing if n not in f.tensors]
    if "output_norm.weight" not in f.tensors:
        missing.insert(0, "output_norm.weight")
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise GGUFError(
            f"{str(f.path)!r} ({arch}) lacks tensor(s) {missing[:5]}{more}; the file is incomplete"
        )


def _by_layer(plan: list[_Entry]) -> list[list[_Entry]]:
    """``plan`` in groups: the tensors outside the layers, then each ``blk.N``'s."""
    groups: dict[str, list[_Entry]] = {}
    for e in plan:
        m = re.match(r"blk\.(\d+)\.", e.info.name)
        groups.setdefault(m[1] if m else "top", []).append(e)
    # the embedding first: its bytes and its module's buffers, both held a moment, then sit
    # beside nothing else (it is often the largest tensor)
    return [*([groups.pop("top")] if "top" in groups else []), *groups.values()]


def _unpermute(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs, 2) -> (2, pairs), i.e. back
    to RoPE's half-split layout. Whole rows move, so ``t`` may be quantised blocks or a bias."""
    pairs = t.shape[0] // n_heads // 2
    return t.reshape(n_heads, pairs, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _dequantize(blocks: torch.Tensor, type_name: str, cols: int, dtype) -> torch.Tensor:
    """``(rows, row bytes)`` uint8 blocks -> ``(rows, cols)`` in ``dtype`` through gguf's exact
    fp32 dequantisation, a bounded number of rows at a time."""
    gguf = require("gguf", purpose="dequantising a GGUF tensor")
    qtype = gguf.GGMLQuantizationType[type_name]
    rows = blocks.shape[0]
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, _CHUNK_BYTES // (4 * cols))
    for r in range(0, rows, step):
        part = gguf.quants.dequantize(blocks[r : r + step].numpy(), qtype)  # (n, cols) fp32
        out[r : r + step] = torch.from_numpy(part.reshape(-1, cols))
    return out


def _read(f: GGUFFile, e: _Entry, dtype: torch.dtype, keep: bool) -> torch.Tensor:
    """One tensor with its rows in transformers' order: a float tensor in ``dtype``, or with
    ``keep`` (a kept quantised type) its ``(rows, row bytes)`` uint8 blocks."""
    info = e.info
    raw = f.raw(info.name)
    if not info.quantised:
        t = raw.view(_FLOAT_TYPES[info.type_name]).reshape(info.shape)
    else:
        rows = math.prod(info.shape[:-1])
        t = raw.view(rows, -1)  # (rows, cols // block · block bytes)
        if not keep:
            t = _dequantize(t, info.type_name, info.shape[-1], dtype).reshape(info.shape)
    if e.heads:
        t = _unpermute(t, e.heads)
    if t.dtype != torch.uint8:
        t = t.to(dtype)
        if e.minus_one:
            t = t - 1  # llama.cpp stores Gemma's 1 + w
    return t


# -- quantised modules ----------------------------------------------------------------------------


def _quantised(module: nn.Module, fmt: str, blocks, bias, dtype) -> nn.Module | None:
    """The quantised replacement of ``module`` (an ``nn.Linear`` or ``nn.Embedding``) holding
    ``blocks``; None where none exists (the weight is then dequantised)."""
    if isinstance(module, nn.Linear):
        return quant.QuantizedLinear.from_ggml(fmt, blocks, bias=bias, dtype=dtype)
    if isinstance(module, nn.Embedding):
        return quant.QuantizedEmbedding.from_ggml(fmt, blocks, dtype=dtype)
    return None


def _log_mixed(what: str) -> None:
    log_once(("gguf-dequantised", what), logging.INFO, "GGUF: %s; dequantising them", what)


def _block_format(blocks: torch.Tensor, cols: int) -> str:
    """The kept format of ``(rows, row bytes)`` blocks of a ``cols``-wide weight: each kept
    format has its own bytes per block (:func:`selfattn.nn.quant.block_bytes`), so the row width
    tells them apart (a fused q/k/v holds one format: mixed groups are dequantised before)."""
    per_block = {quant.block_bytes(fmt): fmt.upper() for fmt in quant.FORMATS}
    return per_block[blocks.shape[1] * quant.BLOCK // cols]


def _kept(plan: list[_Entry], quantized: bool) -> set[str]:
    """The transformers names that stay quantised: a kept type, and a q/k/v group (fused into
    one ``qkv_proj``) only when all three share it."""
    if not quantized:
        return set()
    kept = {e.hf_name: e.info.type_name for e in plan if e.info.type_name in KEPT_QUANTISED}
    for name in [n for n in kept if n.endswith("self_attn.q_proj.weight")]:
        group = [name.replace(".q_proj.", f".{p}_proj.") for p in "qkv"]
        if len({kept.get(n) for n in group}) != 1:
            _log_mixed(f"q/k/v of a layer in different formats ({name.rsplit('.', 3)[0]})")
            for n in group:
                kept.pop(n, None)
    return set(kept)


def _swap_quantised(model: nn.Module, state: dict, dtype) -> None:
    """Replace each module whose converted weight is still uint8 blocks by its quantised
    module, and put that module's tensors into ``state`` under their names (so
    ``load_state`` sees a complete state). A module without a quantised form dequantises."""
    tied = getattr(model.config, "tie_embeddings", False)
    for name in [k for k, t in state.items() if t.dtype == torch.uint8]:
        path = name.rpartition(".")[0]
        module = model.get_submodule(path)
        cols = module.weight.shape[1]
        blocks = state.pop(name)
        fmt = _block_format(blocks, cols)
        bias = state.pop(f"{path}.bias", None)
        new = _quantised(module, fmt, blocks, bias, dtype)
        if new is None:
            _log_mixed(f"{type(module).__name__} {path!r} has no quantised form")
            state[name] = _dequantize(blocks, fmt, cols, dtype)
            if bias is not None:
                state[f"{path}.bias"] = bias
            continue
        model.set_submodule(path, new)
        if path == "embed" and tied:
            model.lm_head = new.as_linear()
        state.update({f"{path}.{k}": v for k, v in new.state_dict(keep_vars=True).items()})


# -- loading --------------------------------------------------------------------------------------


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None on another C library."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc). A quantised module's buffers are
    built through temporaries; freed between the buffers kept, they stay counted in the
    process's memory unless returned (measured: a third of a Q4 model's bytes)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# The float types of a file's weights that "auto" builds in as they are; F16 is a storage format
# on a CPU (its products run slowly there), so it computes as quantised files do.
_AUTO_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}


def _gguf_dtype(dtype, f: GGUFFile | None = None) -> torch.dtype:
    """The dtype a GGUF model is built in. ``"auto"``/None: the type of the file's weights
    (its 2-D tensors) where it is F32 or BF16, else (quantised or F16 weights) the dtype this
    CPU computes fastest (:func:`selfattn.models.bundled.auto_dtype`: bfloat16 where the CPU
    has native bf16 products, else float32). Names and torch dtypes as for folders."""
    if dtype is not None and dtype != "auto":
        return hub.load_dtype(dtype, {}, [])
    types = {
        t.type_name for t in (f.tensors.values() if f is not None else ()) if len(t.shape) == 2
    }
    if len(types) == 1 and next(iter(types)) in _AUTO_DTYPES:
        return _AUTO_DTYPES[next(iter(types))]
    from selfattn.models.bundled import auto_dtype

    return auto_dtype()


def load_gguf(
    path,
    dtype: torch.dtype | str | None = "auto",
    *,
    device: torch.device | str | None = None,
    quantized: bool = True,
) -> nn.Module:
    """Build the model a GGUF file describes and load its weights (see the module docstring).

    ``dtype``: ``"auto"`` (the file's float type, or for quantised weights the CPU's fastest:
    :func:`_gguf_dtype`) or a floating dtype / its name: the
    dtype of every dense weight and of the quantised modules' outputs. ``quantized``: Q8_0,
    Q4_0 and Q4_1 linear and embedding weights stay quantised (``selfattn.nn.quant``; a fused
    q/k/v only when all three share a format); False dequantises everything to ``dtype``. Other
    quantised types are always dequantised exactly (gguf's fp32) and cast.

    The model is built on the meta device and loaded layer by layer: peak memory is the loaded
    weights plus one layer in flight. The model remembers its source: ``gguf_path``,
    ``hf_config`` (the config dict), ``name`` / ``name_or_path`` (``general.name``),
    ``generation_config`` (bos/eos/pad ids) and a ``save_pretrained(folder)`` method
    (:func:`save_pretrained`).
    """
    f = open_gguf(path, arrays=False)
    config = gguf_config(f)
    plan = _plan(f, config)
    _check_shapes(f, config)
    dtype = _gguf_dtype(dtype, f)
    device = torch.device("cpu") if device is None else torch.device(device)
    try:
        model = hub.build(config, str(f.path)).to(dtype)
    except (hub.CheckpointError, hub.UnsupportedConfigError) as err:  # sizes that do not fit
        raise GGUFError(
            f"{str(f.path)!r}: its metadata describes no model we build: {err}"
        ) from None
    kept = _kept(plan, quantized)
    converted = {}
    # Layer by layer (the conversion of a Llama-family layer needs only its own tensors, q/k/v
    # fused among them): a layer's file bytes become its modules before the next is read.
    for group in _by_layer(plan):
        part = {e.hf_name: _read(f, e, dtype, e.hf_name in kept) for e in group}
        part = model.convert_hf_state_dict(part)
        _swap_quantised(model, part, dtype)
        converted |= part
        _release_freed_memory()
    try:
        hub.load_state(model, converted, assign=True, device=device)
    except hub.CheckpointError as err:
        raise GGUFError(f"{str(f.path)!r}: {err}") from None
    hub.check_loaded(model)
    model = model.to(device).eval()
    model.gguf_path = f.path
    model.hf_config = config
    model.name = model.name_or_path = config.get("_name_or_path") or f.path.stem
    model.generation_config = _generation_config(config)
    model.save_pretrained = types.MethodType(save_pretrained, model)
    return model


def _generation_config(config: Mapping) -> dict:
    """transformers' ``generation_config.json`` keys the metadata gives (the stop ids)."""
    return {k: config[k] for k in hub.GENERATION_KEYS if config.get(k) is not None}


# -- GGUF -> transformers folder ------------------------------------------------------------------

_SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float64: "F64"}  # fmt: skip


def save_pretrained(model_or_path, folder, *, dtype: torch.dtype = torch.float32, tokenizer=None):
    """Write a transformers checkpoint folder from a GGUF-loaded model (or a GGUF path):
    ``config.json``, ``generation_config.json`` and ``model.safetensors`` with transformers'
    tensor names, dequantised to ``dtype`` (float32 default), streamed from the GGUF file one
    tensor at a time (Q/K rows un-permuted, Gemma norms as transformers stores them).

    ``tokenizer``: a callable ``tokenizer(gguf_path, folder)`` that writes the tokenizer files;
    None (default): :func:`_save_tokenizer` (transformers' tokenizer files from the file's
    ``tokenizer.ggml.*`` metadata); False: none. Returns the folder's path."""
    source = getattr(model_or_path, "gguf_path", None) or model_or_path
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            "save_pretrained needs a model loaded from a GGUF file (it has .gguf_path) or the "
            f"file's path, got {type(model_or_path).__name__}"
        )
    if dtype not in _SAFETENSORS_NAMES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_NAMES)}, got {dtype}")
    f = open_gguf(source, arrays=False)
    config = dict(gguf_config(f), torch_dtype=str(dtype).removeprefix("torch."))
    plan = _plan(f, config)
    _check_shapes(f, config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = json.dumps(_generation_config(config), indent=2)
    (folder / "generation_config.json").write_text(generation)
    _write_safetensors(f, plan, folder / "model.safetensors", dtype)
    if tokenizer is None:
        tokenizer = _save_tokenizer
    if tokenizer is not False:
        tokenizer(f.path, folder)
    return folder


def _save_tokenizer(path: Path, folder: Path) -> None:
    """The GGUF file's tokenizer as transformers' ``tokenizer.json`` and
    ``tokenizer_config.json`` (:mod:`selfattn.models.gguf_tokenizer`); nothing for a file
    without ``tokenizer.ggml.model``."""
    metadata = read_metadata(path)
    if "tokenizer.ggml.model" not in metadata:
        return
    tokenizer = gguf_tokenizer.tokenizer_from_metadata(metadata, str(path))
    gguf_tokenizer.save_tokenizer(tokenizer, folder)


def _write_safetensors(f: GGUFFile, plan: list[_Entry], out: Path, dtype) -> None:
    """safetensors' layout (8-byte header length, JSON header, data) written tensor by tensor:
    the header is known from the shapes before any tensor is read."""
    size = torch.tensor([], dtype=dtype).element_size()
    header, offset = {}, 0
    for e in plan:
        n = math.prod(e.info.shape) * size
        header[e.hf_name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(e.info.shape),
                             "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for e in plan:
            t = _read(f, e, dtype, keep=False).contiguous()
            fh.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _gguf_tokenizer(source: Path) -> Tokenizer:
    return gguf_tokenizer.tokenizer_from_metadata(read_metadata(source), str(source))


hub.register_format(gguf_source, load_gguf)
register_tokenizer_format(gguf_source, _gguf_tokenizer)
