"""Loading transformers-format folders into selfattn's own model classes (safetensors only).

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Pickle files (``*.bin``, ``*.pt``, ``*.pth``) are refused: loading
them runs arbitrary code.

A model family registers its class for one or more ``config["model_type"]`` values with
:func:`register`. The class provides ``from_config(config: dict) -> model`` (raising
:class:`UnsupportedConfigError` for an option it does not implement) and
``convert_hf_state_dict(state) -> state`` (transformers' tensor names → the module's own
``state_dict`` names); :func:`from_pretrained` then assigns the tensors with
:func:`load_state`, which names every missing, unexpected, mis-shaped and mis-typed tensor.

Every error about the folder's content is a :class:`CheckpointError` (or
:class:`UnsupportedConfigError`) naming the file it is about: invalid JSON, a config that is not a
JSON object, a missing required key (:class:`ConfigKeyError`, with ``file`` and ``key``), a
truncated shard, a shard name that leaves the folder.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from selfattn._optional import available, require
from selfattn.nn import quant

__all__ = [
    "CheckpointError",
    "ConfigKeyError",
    "UnsupportedConfigError",
    "from_pretrained",
    "load_dtype",
    "load_state",
    "read_config",
    "read_safetensors",
    "register",
    "register_format",
    "register_quantization",
    "resolve",
]

# Modules under selfattn.models whose import registers model families (imported on first lookup,
# so the registry never depends on what the caller imported).
_FAMILY_MODULES = (
    "encoder", "decoder", "seq2seq", "vision", "llama4", "deepseek", "hybrid", "qwen3next",
)  # fmt: skip
_REGISTRY: dict[str, type] = {}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
log = logging.getLogger("selfattn")


class CheckpointError(ValueError):
    """A checkpoint folder or its tensors do not match what the model needs."""


class ConfigKeyError(CheckpointError):
    """A required key is missing from a config; ``file`` is the config's path (None for a dict
    that was not read from a file) and ``key`` the missing key."""

    file: Path | None = None
    key: str | None = None


class UnsupportedConfigError(ValueError):
    """A config option the model classes do not implement."""


def _where(config: Mapping) -> str:
    """``"'folder/config.json': "`` for a config read by :func:`read_config`, else ``""``."""
    file = getattr(config, "file", None)
    return f"{str(file)!r}: " if file is not None else ""


def missing_key(config: Mapping, key: str) -> ConfigKeyError:
    """The error for a required ``key`` absent from ``config``: names the file, key, model_type."""
    error = ConfigKeyError(
        f"{_where(config)}config has no {key!r} ({config.get('model_type', '?')}), a required "
        "key; add it"
    )
    error.file, error.key = getattr(config, "file", None), key
    return error


class _Config(dict):
    """A ``config.json`` object that knows its ``file``: ``config[key]`` of a missing key raises
    :class:`ConfigKeyError` naming the file and the key (never a bare ``KeyError``)."""

    file: Path

    def __missing__(self, key):
        raise missing_key(self, key)


def register(*model_types: str) -> Callable[[type], type]:
    """Class decorator: ``from_pretrained`` builds ``cls`` for these ``config["model_type"]``."""
    if not model_types:
        raise TypeError("register() needs at least one model_type string")

    def deco(cls: type) -> type:
        for t in model_types:
            _REGISTRY[t] = cls
        return cls

    return deco


def registered() -> dict[str, type]:
    """``model_type -> class`` for every family (importing the family modules first)."""
    for name in _FAMILY_MODULES:
        try:
            importlib.import_module(f"selfattn.models.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"selfattn.models.{name}":
                raise
    return dict(_REGISTRY)


def unsupported(config: Mapping, key: str, why: str) -> UnsupportedConfigError:
    """The error for an unimplemented option: names the key, its value and the reason."""
    return UnsupportedConfigError(
        f"{_where(config)}config option {key}={config.get(key)!r} "
        f"({config.get('model_type', '?')}) is not supported: {why}"
    )


def _folder(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint folder {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(
            f"{str(p)!r} is a file; pass the folder holding config.json and *.safetensors"
        )
    return p


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true/false"}


def read_json(path, expected: type = dict):
    """The JSON value of ``path``, which must be ``expected`` (``dict``: an object, ``list``: an
    array); :class:`CheckpointError` naming the file when it is not valid UTF-8 JSON or holds
    another kind of value."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, expected):
        got = "null" if data is None else _JSON_KINDS.get(type(data), "a number")
        raise CheckpointError(
            f"{str(path)!r} holds {got} ({_preview(data)}); expected {_JSON_KINDS[expected]}"
        )
    return data


def _preview(value, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_config(path) -> dict:
    """The folder's ``config.json`` as a dict whose missing keys raise :class:`ConfigKeyError`
    naming the file (its ``file`` attribute is the path)."""
    f = _folder(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{str(f.parent)!r} has no config.json; it is not a model folder")
    config = _Config(read_json(f))
    config.file = f
    return config


def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` (symlinks followed) lies in ``folder``, or in the ``blobs/`` folder that a
    Hugging Face cache snapshot (``<repo>/snapshots/<revision>/``) links its files to."""
    real, root = path.resolve(), folder.resolve()
    if real.is_relative_to(root):
        return True
    return root.parent.name == "snapshots" and real.is_relative_to(root.parent.parent / "blobs")


def _shard_path(folder: Path, name: str, index: Path) -> Path:
    """``folder / name`` for a shard ``name`` listed in ``index``, refused unless it stays inside
    ``folder``: an index could otherwise make the loader read any file on the machine (``../x``,
    ``/etc/x``, a link)."""
    source = f"{str(index)!r} lists shard"
    rel = PurePath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(
            f"{source} {name!r}, which is outside the folder {str(folder)!r}; shard names must "
            "be file names inside it"
        )
    path = folder / rel
    if path.exists() and not _inside(folder, path):
        raise CheckpointError(
            f"{source} {name!r}, a link to {str(path.resolve())!r} outside the folder "
            f"{str(folder)!r}; copy the shard into the folder"
        )
    return path


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: the shards its ``model.safetensors.index.json``
    lists (each a file inside the folder; links into a Hugging Face cache's ``blobs/`` are
    followed), else every ``*.safetensors`` file of the folder, links included."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{str(index)!r} has no weight_map")
        bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v]
        if bad:
            raise CheckpointError(
                f"{str(index)!r} maps tensor {bad[0][0]!r} to {bad[0][1]!r}; weight_map values "
                "must be shard file names"
            )
        names = sorted(set(weight_map.values()))
        files = [_shard_path(folder, n, index) for n in names]
        missing = [n for n, f in zip(names, files) if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{str(index)!r} lists shard(s) {missing} that are not in the folder"
            )
        return files
    # the folder's own files, links included (a folder may link weights kept elsewhere)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        hint = (
            f"; it holds pickle file(s) {pickles}, which are never loaded (they can run code): "
            "convert them with safetensors.torch.save_file"
            if pickles
            else ""
        )
        raise CheckpointError(f"{str(folder)!r} has no *.safetensors file{hint}")
    return files


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"shard {str(path)!r} cannot be read ({e}); it is truncated or not a safetensors "
        "file: download or convert it again"
    )


@functools.cache
def _log_mmap_fallback(e: str) -> None:
    log.info(
        "safetensors has no pread backend (%s): shards are read through mmap, which holds a "
        "second copy of a shard while its tensors are cast; pip install -U safetensors",
        e,
    )


def _open(path: Path):
    """``safe_open`` on a shard, reading tensors with ``pread`` into memory of their own: through
    the default mmap a cast tensor and the mapped pages of its source would both count, twice the
    shard's bytes at the peak."""
    safetensors = require("safetensors", purpose="loading a checkpoint")
    SafetensorError, safe_open = safetensors.SafetensorError, safetensors.safe_open

    try:
        try:
            return safe_open(str(path), framework="pt", backend="pread")
        except TypeError as e:  # an older safetensors: mmap only
            _log_mmap_fallback(str(e))
            return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None


# safetensors' names of the floating dtypes a model is loaded in
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def first_float_dtype(files: list[Path]) -> torch.dtype | None:
    """The dtype of the first floating tensor of the first shard that has one (read from the
    headers only), as transformers' ``dtype="auto"`` does for a config without ``dtype``."""
    for f in files:
        with _open(f) as handle:
            names = handle.keys()  # safe_open is not iterable
            for name in names:
                dtype = _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def read_safetensors(
    path,
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    progress: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s) (see :func:`checkpoint_files`).

    Shard by shard, tensor by tensor: each is read, cast to floating ``dtype`` (integer and bool
    tensors keep theirs, and so do the tensors whose name ``keep`` accepts: a quantised
    checkpoint's scales) and moved to ``device`` before the next is read, so the result is the
    only copy in memory (a float32 checkpoint loaded as bfloat16 never exists whole in float32).
    ``progress`` shows a tqdm bar over the shards when there are several.
    """
    SafetensorError = require("safetensors", purpose="loading a checkpoint").SafetensorError

    files = checkpoint_files(_folder(path))
    listed_in = files[0].parent / "model.safetensors.index.json"
    listed = f", listed in {str(listed_in)!r})" if listed_in.is_file() else ")"
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for f in _progress(files, progress):
        with _open(f) as handle:
            try:
                names = handle.keys()  # safe_open is not iterable
                for name in names:
                    if name in state:
                        raise CheckpointError(
                            f"tensor {name!r} appears in more than one shard ({origin[name]!r} "
                            f"and {f.name!r}" + listed
                        )
                    cast = None if keep is not None and keep(name) else dtype
                    state[name], origin[name] = _read_tensor(handle, name, cast, device), f.name
            except (SafetensorError, OSError) as e:
                raise _unreadable(f, e) from None
    return state


def _read_tensor(handle, name: str, dtype: torch.dtype | None, device) -> torch.Tensor:
    """Tensor ``name`` of an open shard, a floating one cast to ``dtype``, on ``device``. A cast
    holds the source tensor in flight: the peak of a float32 checkpoint loaded as bfloat16 is the
    bfloat16 weights plus its largest float32 tensor (safetensors' pread reads a whole tensor
    even for a slice of rows, so reading by blocks would cost more than it saves)."""
    t = handle.get_tensor(name)
    return t.to(device=device, dtype=dtype if t.is_floating_point() else None)


def _progress(files: list[Path], enabled: bool):
    if not enabled or len(files) < 2:
        return files
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a nicety: load without it
        return files
    return tqdm(files, desc="Loading checkpoint shards", unit="shard")


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    return "float" if t.is_floating_point() else "complex" if t.is_complex() else "integer"


def _fill_aliases(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every name of a tied tensor filled from the first of its names that
    ``state`` holds (transformers saves a tied LM head once, under the embedding's name); the
    others are dropped, so the first name wins, as transformers ties to the input embeddings."""
    state = dict(state)
    groups: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False)]
    named += model.named_buffers(remove_duplicate=False)
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state]
        if len(names) > 1 and present:
            for n in names:
                state[n] = state[present[0]]
    return state


def load_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    sources: Mapping[str, str] | None = None,
    *,
    assign: bool = False,
    device: torch.device | str | None = None,
) -> None:
    """Load ``state`` into ``model``'s parameters and buffers, all or nothing.

    Raises :class:`CheckpointError` naming every missing, unexpected, mis-shaped (with both
    shapes) and mis-typed tensor (an integer or bool tensor for a float parameter, or the
    reverse: a cast would silently convert it) before anything is loaded. ``sources`` maps a
    converted name to the checkpoint's own name, so errors name the tensor as the file spells it
    too. Tied tensors (one tensor under several names) need only one of their names.
    Non-persistent buffers are not expected in ``state``.

    ``assign=False`` copies into the model's tensors. ``assign=True`` (``load_state_dict(...,
    assign=True)``-style) makes ``state``'s tensors the model's own, cast to each model tensor's
    dtype and moved to ``device`` (None: where they are): the model may live on the meta device,
    and no second copy of the weights is ever made. Ties survive: a tied group gets one
    :class:`~torch.nn.Parameter`.
    """
    sources = sources or {}

    def named(k: str) -> str:
        return f"{k} (checkpoint {sources[k]!r})" if k in sources else k

    state = _fill_aliases(model, state)
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    common = sorted(set(own) & set(state))
    shapes = [
        f"{named(k)}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in common
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    kinds = [
        f"{named(k)}: checkpoint {_kind(state[k])} {state[k].dtype} vs model {_kind(own[k])} "
        f"{own[k].dtype}"
        for k in common
        if _kind(state[k]) != _kind(own[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {missing}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {[named(k) for k in unexpected]}")
    if shapes:
        problems.append("mis-shaped tensor(s): " + "; ".join(shapes))
    if kinds:
        problems.append("mis-typed tensor(s): " + "; ".join(kinds))
    if problems:
        raise CheckpointError(
            f"checkpoint does not fit {type(model).__name__}: " + "; ".join(problems)
        )
    with torch.no_grad():
        if not assign:
            for k, t in own.items():
                t.copy_(state[k])
            return
        made: dict[int, torch.Tensor] = {}  # id(old tensor) -> its replacement (ties)
        used: set[int] = set()  # state tensors already given to a model tensor
        for k, old in own.items():
            new = made.get(id(old))
            if new is None:
                t = state[k]
                if id(t) in used:  # one checkpoint tensor for two untied model tensors
                    t = t.clone()
                used.add(id(t))
                t = t.to(device=device, dtype=old.dtype if old.is_floating_point() else None)
                if isinstance(old, nn.Parameter):
                    t = nn.Parameter(t, requires_grad=old.requires_grad)
                new = made[id(old)] = t
            module_name, _, leaf = k.rpartition(".")
            module = model.get_submodule(module_name)
            slot = module._parameters if leaf in module._parameters else module._buffers
            slot[leaf] = new


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "double": torch.float64,
}


def load_dtype(dtype, config: Mapping, files: list[Path]) -> torch.dtype:
    """The floating dtype ``from_pretrained`` builds: ``dtype`` itself, a name from ``_DTYPES``,
    or ``"auto"``/None: the config's ``dtype`` (transformers 5) or ``torch_dtype``, else the
    checkpoint's first floating tensor's, else float32."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        named = config.get("dtype") or config.get("torch_dtype")
        if named is None:
            return first_float_dtype(files) or torch.float32
        if named not in _DTYPES:
            raise CheckpointError(
                f"{_where(config)}config dtype {named!r} is not a floating dtype; expected one "
                f"of {sorted(_DTYPES)}, or pass dtype= to from_pretrained"
            )
        return _DTYPES[named]
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(
        f"dtype must be 'auto', a torch floating dtype or one of {sorted(_DTYPES)}, got {dtype!r}"
    )


# Files of a Hub repository that loading a model or its tokenizer reads.
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def resolve(
    path_or_repo_id,
    *,
    revision: str | None = None,
    cache_dir=None,
    local_files_only: bool = False,
) -> Path:
    """The local folder of ``path_or_repo_id``: the folder itself when it exists, else the
    snapshot of the Hugging Face Hub repository ``"owner/name"`` through ``huggingface_hub``'s
    cache (downloading what is missing unless offline: ``local_files_only``, ``HF_HUB_OFFLINE``;
    huggingface_hub falls back to the cache when the network fails)."""
    path = Path(path_or_repo_id)
    text = str(path_or_repo_id)
    if path.exists() or not isinstance(path_or_repo_id, str) or not _REPO_ID.fullmatch(text):
        return _folder(path)
    if not available("huggingface_hub"):
        raise FileNotFoundError(
            f"checkpoint folder {text!r} does not exist; to load it as a Hugging Face Hub "
            "repository id, pip install 'selfattn[models]' (it brings huggingface_hub)"
        )
    hub = require("huggingface_hub", purpose="loading a Hub repository id")
    constants, snapshot_download = hub.constants, hub.snapshot_download
    EntryNotFoundError = require("huggingface_hub.errors").EntryNotFoundError
    offline = local_files_only or constants.is_offline_mode()
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        folder = snapshot_download(
            text,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            allow_patterns=_HUB_FILES,
        )
    except (OSError, ValueError, EntryNotFoundError) as e:
        cache = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        how = "offline (HF_HUB_OFFLINE or local_files_only)" if offline else "online"
        raise FileNotFoundError(
            f"{text!r} is not a folder, and as a Hugging Face Hub repository id it was not found "
            f"({how}, cache {str(cache)!r}): {type(e).__name__}: {e}"
        ) from None
    return Path(folder)


# In-place random fills (and the nn.init functions made of them) that a module's constructor runs.
_RANDOM_FILLS = frozenset(
    {
        *("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_"),
        *("xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_"),
    }
)


# Random tensor factories a module's constructor calls (`torch.randn(S, d) * 0.02`): on the meta
# device they make an empty meta tensor of the same size instead, and so does the scaling by a
# number after them (a meta tensor's arithmetic also runs through torch._refs).
_RANDOM_FACTORIES = frozenset({"randn", "rand"})
_SCALINGS = frozenset({"mul", "__mul__", "__rmul__", "div", "__truediv__"})


class _SkipMetaInit(TorchFunctionMode):
    """Random initialisation of a meta tensor is skipped: it fills nothing, yet torch runs it
    through ``torch._refs``, whose first call imports ``torch._dynamo`` (measured: 150 MiB of RSS
    and seconds, more than loading a small model). Used inside ``torch.device("meta")`` only:
    a random factory without an explicit device is an empty tensor there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
        name = getattr(func, "__name__", "")
        if name in _RANDOM_FILLS and isinstance(t, torch.Tensor) and t.is_meta:
            return t
        if name in _RANDOM_FACTORIES and kwargs.get("device") is None and "generator" not in kwargs:
            return torch.empty(*args, **kwargs)  # the device mode outside makes it meta
        if (
            name in _SCALINGS
            and isinstance(t, torch.Tensor)
            and t.is_meta
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], (int, float))
        ):
            return torch.empty(t.shape, dtype=torch.result_type(t, args[1]), device="meta")
        return func(*args, **kwargs)


def build(config: Mapping, source: str) -> nn.Module:
    """The model of the family registered for ``config["model_type"]``, built on the meta
    device (shapes only: a checkpoint fills every tensor); errors name ``source``, the file
    the config came from."""
    model_type = config.get("model_type")
    families = registered()
    if not isinstance(model_type, str) or model_type not in families:
        raise UnsupportedConfigError(
            f"unknown architecture model_type={model_type!r} in {source!r}; "
            f"supported: {sorted(families)}"
        )
    cls = families[model_type]
    try:
        with torch.device("meta"), _SkipMetaInit():
            return cls.from_config(config)
    except (CheckpointError, UnsupportedConfigError):
        raise
    except (KeyError, AttributeError, TypeError, IndexError, ValueError) as e:
        # a value of the wrong kind (a list where a number belongs, a nested key missing): name
        # the file, keep the builder's message and traceback
        raise CheckpointError(
            f"{source!r} does not describe a valid {cls.__name__} ({model_type}): "
            f"{type(e).__name__}: {e}"
        ) from e


def check_loaded(model: nn.Module) -> None:
    """:class:`CheckpointError` naming the tensors a load left on the meta device."""
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(
            f"{type(model).__name__} still has tensors on the meta device after loading {left}: "
            "a module makes state that is neither in the checkpoint nor computed on the CPU "
            "when built under torch.device('meta'); compute it there (see positions/rope.py)"
        )


# Checkpoint formats besides a transformers folder, each registered by its own module on import
# (gguf.py: selfattn.models imports it): ``(source, load)``, ``source(path_or_repo_id)`` the
# file it would read or None, ``load(file, dtype, device=, quantized=)`` the model.
_FORMATS: list[tuple[Callable, Callable]] = []


def register_format(source: Callable, load: Callable) -> None:
    """Let :func:`from_pretrained` load what ``source`` recognises with ``load``."""
    _FORMATS.append((source, load))


# Quantised transformers checkpoints (``quantization_config`` in config.json), by ``quant_method``:
# ``packing(qconfig, config, quantized)`` -> an object with ``keeps(name)`` (the tensors read in
# their own dtype: scales), ``unpack(state, dtype)`` (each packed layer's tensors -> its
# QuantizedLinear buffers, in place, before the family's conversion) and ``swap(model, state,
# dtype, device)`` (after it: each module given buffers becomes a QuantizedLinear). hf_quant.py
# registers AWQ, GPTQ and compressed-tensors (selfattn.models imports it).
_QUANT_METHODS: dict[str, Callable] = {}


def register_quantization(method: str, packing: Callable) -> None:
    """Let :func:`from_pretrained` load checkpoints whose ``quant_method`` is ``method``."""
    _QUANT_METHODS[method] = packing


def quantization(config: Mapping, quantized: bool):
    """The packing of a checkpoint whose config has a ``quantization_config`` (None without
    one); :class:`UnsupportedConfigError` for a method we do not load."""
    qconfig = config.get("quantization_config")
    if qconfig is None:
        return None
    method = qconfig.get("quant_method") if isinstance(qconfig, Mapping) else None
    if method not in _QUANT_METHODS:
        raise UnsupportedConfigError(
            f"{_where(config)}quantization_config.quant_method={method!r} is not supported: "
            f"quantised checkpoints load from {sorted(_QUANT_METHODS)}; dequantise it with its "
            "own tool or load an unquantised checkpoint"
        )
    return _QUANT_METHODS[method](qconfig, config, quantized)


def from_pretrained(
    path_or_repo_id,
    dtype: torch.dtype | str | None = "auto",
    *,
    device: torch.device | str | None = None,
    revision: str | None = None,
    cache_dir=None,
    local_files_only: bool = False,
    progress: bool = True,
    quantized: bool = True,
    quantize: str | None = None,
    quantize_group: int | None = None,
) -> nn.Module:
    """Build the model a transformers-format checkpoint describes and load its weights.

    Args:
        path_or_repo_id: a folder with ``config.json`` and ``*.safetensors`` (sharded index
            included), or a Hub id ``"owner/name"`` resolved through huggingface_hub's cache
            (:func:`resolve`; ``revision``, ``cache_dir``, ``local_files_only`` go there). A GGUF
            file (or a folder holding one ``*.gguf`` and no ``config.json``) is loaded by
            :func:`selfattn.models.gguf.load_gguf` (``dtype="auto"`` there: an F32/BF16 file's
            own type, a quantised one's fastest on this CPU; ``quantized=False`` dequantises its
            Q8_0/Q4_0/Q4_1 weights to ``dtype``).
        dtype: ``"auto"`` (default, as transformers 5; None means the same): the config's
            ``dtype`` / ``torch_dtype``, else the checkpoint's first floating tensor's dtype;
            or a floating ``torch.dtype`` or its name (``"bfloat16"``, ``"float16"``,
            ``"float32"``, ...). Floating weights are cast to it tensor by tensor.
        device: where the weights go (default CPU); each tensor moves there as it is read.
        progress: a tqdm bar over the shards of a sharded checkpoint.
        quantize: ``"int8"`` (one scale per output channel), ``"int4"`` (groups of
            ``quantize_group`` inputs, default 32, with zero points) or ``"int4_sym"``: every
            ``nn.Linear`` (the decoder blocks' projections and the LM head) is replaced by a
            weight-only quantised :class:`selfattn.nn.QuantizedLinear` after loading
            (:func:`selfattn.nn.quant.quantize_`, round to nearest); embeddings stay as loaded.
            Layers a GGUF file keeps quantised stay in its format, and so do a quantised
            checkpoint's.
        quantize_group: the inputs sharing a scale (a multiple of 32), or None for the
            format's default.
        quantized: a checkpoint quantised by AWQ, GPTQ or compressed-tensors (a
            ``quantization_config`` in config.json) keeps its packed layers as
            :class:`selfattn.nn.QuantizedLinear` in ``dtype`` (:mod:`selfattn.models.hf_quant`:
            the formats and options; q/k/v fused as the model fuses them); False dequantises
            them to ``dtype``. Likewise for a GGUF file's blocks.

    The model is built on the meta device (no memory, no random init) and takes the checkpoint's
    tensors as its own (:func:`load_state` with ``assign=True``): peak memory is one copy of the
    weights in ``dtype`` plus one tensor in flight, whatever the checkpoint's own dtype.

    Returns:
        The model in eval mode. A causal LM is called as ``model(input_ids (B, S),
        attention_mask=None) -> logits (B, S, vocab)``.
    """
    if quantize is not None and quantize not in quant.QUANTIZE_FORMATS:
        raise ValueError(
            f"quantize={quantize!r}: expected one of {quant.QUANTIZE_FORMATS} (or None: keep "
            "the checkpoint's weights)"
        )
    for source, load in _FORMATS:
        found = source(path_or_repo_id)
        if found is not None:
            model = load(found, dtype, device=device, quantized=quantized)
            return _quantized(model, quantize, quantize_group)
    folder = resolve(
        path_or_repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    config = read_config(folder)
    packing = quantization(config, quantized)
    model = build(config, str(config.file))
    dtype = load_dtype(dtype, config, checkpoint_files(folder))
    device = torch.device("cpu") if device is None else torch.device(device)
    model = model.to(dtype)
    keep = None if packing is None else packing.keeps
    state = read_safetensors(folder, dtype, device=device, progress=progress, keep=keep)
    # tensors a conversion only renames keep their identity: errors then name both spellings
    names = {id(t): (k, weakref.ref(t)) for k, t in state.items()}
    try:
        if packing is not None:
            packing.unpack(state, dtype)
        converted = model.convert_hf_state_dict(state)  # may take the tensors out of `state`
        del state
        if packing is not None:
            packing.swap(model, converted, dtype, device)
        sources = {}
        for k, t in converted.items():
            source, ref = names.get(id(t), (k, None))
            if source != k and ref is not None and ref() is t:
                sources[k] = source
        load_state(model, converted, sources, assign=True, device=device)
    except CheckpointError as e:  # about the folder's tensors: say which folder
        raise CheckpointError(f"{str(folder)!r}: {e}") from None
    check_loaded(model)
    model.generation_config = read_generation_config(folder)
    return _quantized(model.to(device).eval(), quantize, quantize_group)


def _quantized(model: nn.Module, fmt: str | None, group: int | None) -> nn.Module:
    """``model`` with its linear layers quantised to ``fmt`` (None: as it is)."""
    return model if fmt is None else quant.quantize_(model, fmt, group=group).eval()


# transformers' generation_config.json keys that selfattn's generate and serving read.
GENERATION_KEYS = (
    "eos_token_id", "bos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p",
    "max_new_tokens", "max_length", "repetition_penalty",
)  # fmt: skip


def read_generation_config(folder) -> dict:
    """The checkpoint's generation defaults (``generation_config.json``: transformers' keys of
    :data:`GENERATION_KEYS`, those set and not None) as a plain dict; ``{}`` without the file.
    ``from_pretrained`` sets it as ``model.generation_config``: :func:`selfattn.models.generate`
    and the serving engine use it where a call gives no value, as transformers does.

    With the file, ``eos_token_id`` is always a key (None where the file has none): as in
    transformers, a generation config that names no end token stops nowhere, whatever
    ``config.json`` says; without the file, the model's ``eos_token_id`` applies."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    data = read_json(path)
    out = {k: data[k] for k in GENERATION_KEYS if data.get(k) is not None}
    out.setdefault("eos_token_id", None)
    return out
