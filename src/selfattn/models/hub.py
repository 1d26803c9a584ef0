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

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath

import torch
from torch import nn

from selfattn._optional import require

__all__ = [
    "CheckpointError",
    "ConfigKeyError",
    "UnsupportedConfigError",
    "from_pretrained",
    "load_state",
    "read_config",
    "read_safetensors",
    "register",
]

# Modules under selfattn.models whose import registers model families (imported on first lookup,
# so the registry never depends on what the caller imported).
_FAMILY_MODULES = ("encoder", "decoder", "seq2seq", "vision")
_REGISTRY: dict[str, type] = {}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    safetensors = require("safetensors", purpose="loading a checkpoint")
    load_file = require("safetensors.torch", purpose="loading a checkpoint").load_file

    try:
        return load_file(str(path))
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(
            f"shard {str(path)!r} cannot be read ({e}); it is truncated or not a safetensors "
            "file: download or convert it again"
        ) from None


def read_safetensors(path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), optionally cast to floating ``dtype``.

    Shards listed in ``model.safetensors.index.json`` must be files inside the folder (links
    into a Hugging Face cache's ``blobs/`` are followed); without an index every
    ``*.safetensors`` file of the folder is read, links included."""
    folder = _folder(path)
    index = folder / "model.safetensors.index.json"
    listed_in = None  # the index, when there is one
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
        listed_in = index
    else:
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
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for f in files:
        for name, t in _load_shard(f).items():
            if name in state:
                raise CheckpointError(
                    f"tensor {name!r} appears in more than one shard ({origin[name]!r} and "
                    f"{f.name!r}" + (f", listed in {str(listed_in)!r})" if listed_in else ")")
                )
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            state[name], origin[name] = t, f.name
    return state


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    return "float" if t.is_floating_point() else "complex" if t.is_complex() else "integer"


def load_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    sources: Mapping[str, str] | None = None,
) -> None:
    """Copy ``state`` into ``model``'s parameters and buffers, all or nothing.

    Raises :class:`CheckpointError` naming every missing, unexpected, mis-shaped (with both
    shapes) and mis-typed tensor (an integer or bool tensor for a float parameter, or the
    reverse: ``copy_`` would silently convert it) before anything is copied. ``sources`` maps a
    converted name to the checkpoint's own name, so errors name the tensor as the file spells it
    too.
    Non-persistent buffers are not expected in ``state``.
    """
    sources = sources or {}

    def named(k: str) -> str:
        return f"{k} (checkpoint {sources[k]!r})" if k in sources else k

    own = model.state_dict()
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
        for k, t in own.items():
            t.copy_(state[k])


def from_pretrained(path, dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model a transformers-format folder describes and load its weights.

    Args:
        path: folder with ``config.json`` and ``*.safetensors`` (sharded index included).
        dtype: cast floating weights and the model to this dtype (default: float32, the
            dtype the model classes build their parameters in; checkpoint values are cast).

    Returns:
        The model in eval mode. A causal LM is called as ``model(input_ids (B, S),
        attention_mask=None) -> logits (B, S, vocab)``.
    """
    config = read_config(path)
    model_type = config.get("model_type")
    families = registered()
    if not isinstance(model_type, str) or model_type not in families:
        raise UnsupportedConfigError(
            f"unknown architecture model_type={model_type!r} in {str(config.file)!r}; "
            f"supported: {sorted(families)}"
        )
    cls = families[model_type]
    try:
        model = cls.from_config(config)
    except (CheckpointError, UnsupportedConfigError):
        raise
    except (KeyError, AttributeError, TypeError, IndexError, ValueError) as e:
        # a value of the wrong kind (a list where a number belongs, a nested key missing): name
        # the file, keep the builder's message and traceback
        raise CheckpointError(
            f"{str(config.file)!r} does not describe a valid {cls.__name__} ({model_type}): "
            f"{type(e).__name__}: {e}"
        ) from e
    state = read_safetensors(path, dtype=dtype)
    names = {id(t): k for k, t in state.items()}  # tensors a conversion only renames keep their id
    try:
        converted = model.convert_hf_state_dict(state)
        sources = {k: names[id(t)] for k, t in converted.items() if names.get(id(t), k) != k}
        load_state(model, converted, sources)
    except CheckpointError as e:  # about the folder's tensors: say which folder
        raise CheckpointError(f"{str(config.file.parent)!r}: {e}") from None
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
