"""Loading transformers-format folders into selfattn's own model classes (safetensors only).

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Pickle files (``*.bin``, ``*.pt``, ``*.pth``) are refused: loading
them runs arbitrary code.

A model family registers its class for one or more ``config["model_type"]`` values with
:func:`register`. The class provides ``from_config(config: dict) -> model`` (raising
:class:`UnsupportedConfigError` for an option it does not implement) and
``convert_hf_state_dict(state) -> state`` (transformers' tensor names → the module's own
``state_dict`` names); :func:`from_pretrained` then assigns the tensors with
:func:`load_state`, which names every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "CheckpointError",
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


class UnsupportedConfigError(ValueError):
    """A config option the model classes do not implement."""


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
        f"config option {key}={config.get(key)!r} ({config.get('model_type', '?')}) is not "
        f"supported: {why}"
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


def read_config(path) -> dict:
    """The folder's ``config.json`` as a dict."""
    f = _folder(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{str(f.parent)!r} has no config.json; it is not a model folder")
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def read_safetensors(path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), optionally cast to floating ``dtype``."""
    from safetensors.torch import load_file

    folder = _folder(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{str(index)!r} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{str(index)!r} lists shard(s) {missing} that are not in the folder"
            )
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
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
    for f in files:
        for name, t in load_file(str(folder / f)).items():
            if name in state:
                raise CheckpointError(f"tensor {name!r} appears in more than one shard")
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            state[name] = t
    return state


def load_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    sources: Mapping[str, str] | None = None,
) -> None:
    """Copy ``state`` into ``model``'s parameters and buffers, all or nothing.

    Raises :class:`CheckpointError` naming every missing, unexpected and mis-shaped
    tensor (with both shapes) before anything is copied. ``sources`` maps a converted name to
    the checkpoint's own name, so errors name the tensor as the file spells it too.
    Non-persistent buffers are not expected in ``state``.
    """
    sources = sources or {}

    def named(k: str) -> str:
        return f"{k} (checkpoint {sources[k]!r})" if k in sources else k

    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{named(k)}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {missing}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {[named(k) for k in unexpected]}")
    if shapes:
        problems.append("mis-shaped tensor(s): " + "; ".join(shapes))
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
    if model_type not in families:
        raise UnsupportedConfigError(
            f"unknown architecture model_type={model_type!r} in {str(Path(path))!r}; supported: "
            f"{sorted(families)}"
        )
    cls = families[model_type]
    model = cls.from_config(config)
    state = read_safetensors(path, dtype=dtype)
    names = {id(t): k for k, t in state.items()}  # tensors a conversion only renames keep their id
    converted = model.convert_hf_state_dict(state)
    sources = {k: names[id(t)] for k, t in converted.items() if names.get(id(t), k) != k}
    load_state(model, converted, sources)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
