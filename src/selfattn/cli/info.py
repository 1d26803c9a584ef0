"""``selfattn info``: versions, device (with what ``--threads`` and ``--dtype auto`` choose here,
and why), which registered backends run here
(:func:`selfattn.inspect.backend_availability`) and whether each kernel is available, and why
not: the C decode kernel (compiler, cache, build, CPU features), Triton (installed, importable,
a GPU), FlexAttention (this torch has it; ``--probe`` compiles a tiny call). Never fails for a
missing piece: that is what it reports."""

from __future__ import annotations

import os
import platform

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "info",
        help="versions, device, backends and kernels (available here, or why not)",
        description=(
            "Print versions (selfattn, torch, python, optional packages), the device, the "
            "backends that run here, and each kernel's state: the C decode kernel (compiler, "
            "cache, build, CPU features), Triton (installed, importable, GPU), FlexAttention."
        ),
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--probe",
        action="store_true",
        help="also compile a tiny FlexAttention call on this device (5-20 s on a CPU)",
    )
    p.set_defaults(run=run)
    return p


def _version_of(dist: str) -> str | None:
    import importlib.metadata  # here, not at the top: it would double the cost of --help

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Optional packages whose versions info reports (the extras of pyproject.toml).
_OPTIONAL = ("numpy", "rich", "matplotlib", "safetensors", "tokenizers", "jinja2", "tqdm", "triton")
# CPU feature flags (/proc/cpuinfo spellings) that the C kernels' -march=native code can use;
# amx_bf16 is reported although no kernel uses AMX tiles yet (the machines measured so far lack it).
_CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "asimd",
)


def _cpu_flags() -> list[str]:
    from selfattn.kernels.build import cpu_flags

    return [f for f in _CPU_FLAGS if f in cpu_flags()]


def _captured_warnings(fn):
    """``(fn(), messages)``: what ``fn`` logged on the ``selfattn`` logger (its reasons)."""
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger("selfattn")
    logger.addHandler(handler)
    try:
        return fn(), handler.messages
    finally:
        logger.removeHandler(handler)


def _c_kernel() -> dict:
    """The C paged-decode kernel: compiler, cache, built and loaded, its path, or why not."""
    from selfattn.kernels import paged_decode

    state = _c_state("C paged decode (CPU)", paged_decode.SPEC, paged_decode.ENV_VAR)
    if state["why_not"] is None:
        _load_into(state, paged_decode)
    return state


def _fused_kernel() -> dict:
    """The fused attention kernel (the ``cpu_fused`` backend): as :func:`_c_kernel`."""
    from selfattn.kernels import fused_attention

    state = _c_state("C fused attention (CPU)", fused_attention.SPEC, fused_attention.ENV_VAR)
    if state["why_not"] is None:
        _load_into(state, fused_attention)
    return state


def _c_state(name: str, spec, off_var: str) -> dict:
    """What every C kernel reports before loading: compiler, cache dir, CPU flags, cached; or
    why not (``off_var=0`` turns it off, no compiler)."""
    from selfattn.kernels import build

    cc = build.compiler()
    state = {
        "name": name,
        "compiler": cc,
        "cache_dir": str(build.cache_dir()),
        "cpu_flags": _cpu_flags(),
        "cached": False,
        "loaded": False,
        "dtypes": [],
        "isa": None,
        "openmp": False,
        "why_not": None,
    }
    if os.environ.get(off_var, "1") == "0":
        state["why_not"] = f"{off_var}=0 turns it off"
        return state
    if cc is None:
        state["why_not"] = "no C compiler found ($CC, cc, gcc, clang); e.g. apt-get install gcc"
        return state
    state["cached"] = any(
        (build.cache_dir() / build.library_name(spec, cc, [*spec.flags, *t])).is_file()
        for t in spec.target_flags(cc)
    )
    return state


def _load_into(state: dict, kernel) -> None:
    """Load ``kernel`` (a module with ``library``, ``supported_dtypes``, ``isa``) into ``state``."""
    from selfattn.kernels import threads

    lib, messages = _captured_warnings(kernel.library)  # builds it where not cached
    state["loaded"] = lib is not None
    if lib is None:
        state["why_not"] = " | ".join(messages) or "the build failed (see the selfattn log)"
        return
    state["dtypes"] = [str(d).removeprefix("torch.") for d in kernel.supported_dtypes()]
    state["isa"] = kernel.isa()
    state["openmp"] = threads.openmp(lib)


def _triton() -> dict:
    """Triton: installed, importable, and a device to run on (CUDA, or its CPU interpreter)."""
    import torch

    from selfattn import _optional

    state = {"name": "Triton paged decode (CUDA)", "version": _version_of("triton")}
    state |= {"importable": False, "cuda": torch.cuda.is_available(), "why_not": None}
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not _optional.available("triton"):
        state["why_not"] = "Triton is not installed: pip install 'selfattn[triton]'"
        return state
    try:
        _optional.require("triton")
        state["importable"] = True
    except Exception as e:  # a broken install: say how it broke
        state["why_not"] = f"import triton failed: {type(e).__name__}: {e}"
        return state
    if not (state["cuda"] or interpret):
        state["why_not"] = "no CUDA device (TRITON_INTERPRET=1 runs it on CPU, for tests)"
    return state


def _flex(probe: bool) -> dict:
    """FlexAttention: whether this torch has it, and (``probe``) whether a call compiles here."""
    import torch

    import selfattn as sa

    device = "cuda" if torch.cuda.is_available() else "cpu"
    has = _flex_importable()
    state = {"name": f"FlexAttention ({device})", "torch_has_it": has, "compiles": None}
    state["why_not"] = None if has else f"torch {torch.__version__} has no FlexAttention (2.5+)"
    if has and probe:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 16, 16, generator=g).to(device)
        try:
            with torch.no_grad():
                sa.attention(q, q, q, mask=sa.masks.causal(), backend="flex")
            state["compiles"] = True
        except Exception as e:
            state["compiles"] = False
            state["why_not"] = f"a tiny causal call failed: {type(e).__name__}: {e}"[:300]
    return state


def _flex_importable() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _info(probe: bool = False) -> dict:
    import torch

    import selfattn as sa
    from selfattn.inspect.backend_matrix import backend_availability
    from selfattn.models.bundled import default_threads, dtype_choice

    cuda = torch.cuda.is_available()
    auto, why = dtype_choice("cpu")
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "versions": {
            "selfattn": sa.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            **{name: _version_of(name) for name in _OPTIONAL},
        },
        "device": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "threads_default": default_threads(),  # what --threads defaults to
            "dtype_auto": {"dtype": str(auto).removeprefix("torch."), "why": why},
            "cpu_capability": cpu_capability,
            "cuda_available": cuda,
            "cuda_version": torch.version.cuda,
            "cuda_devices": [
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            ]
            if cuda
            else [],
        },
        "backends": backend_availability(),
        "kernels": [_c_kernel(), _fused_kernel(), _triton(), _flex(probe)],
    }


def run(args) -> int:
    info = _info(args.probe)
    if args.json:
        _common.print_json(info)
        return _common.EXIT_OK
    out = _common.Printer()
    out.table(
        ["component", "version"], [[k, v or "not installed"] for k, v in info["versions"].items()]
    )
    dev = info["device"]
    cuda = ", ".join(dev["cuda_devices"]) if dev["cuda_available"] else "not available"
    out.line()
    out.table(
        ["device", ""],
        [
            ["platform", dev["platform"]],
            ["CPU cores", str(dev["cpu_count"])],
            ["torch threads", str(dev["torch_threads"])],
            ["--threads default", f"{dev['threads_default']} (the cores this process may use)"],
            ["--dtype auto", f"{dev['dtype_auto']['dtype']}: {dev['dtype_auto']['why']}"],
            ["CPU capability", str(dev["cpu_capability"])],
            ["CUDA", cuda],
        ],
    )
    out.line()
    where = "cuda" if dev["cuda_available"] else "cpu"
    rows = [
        [b["name"], "yes", b["doc"] or "-"] if b["available"] else [b["name"], "no", b["why_not"]]
        for b in info["backends"]
    ]
    out.table(
        ["backend", "here", "what it is / why not"],
        rows,
        title=f"backends on a plain fp32 causal case ({where})",
    )
    out.line()
    out.table(
        ["kernel", "here", "details / why not"],
        [[k["name"], _here(k), _details(k)] for k in info["kernels"]],
        title="kernels",
    )
    return _common.EXIT_OK


def _here(k: dict) -> str:
    if k["why_not"] is not None:
        return "no"
    return "not probed" if k.get("compiles", True) is None else "yes"


def _details(k: dict) -> str:
    if "compiler" in k:  # the C kernel
        facts = [f"compiler {k['compiler'] or 'none'}", f"CPU flags {' '.join(k['cpu_flags'])}"]
        if k["loaded"]:
            facts += ["cached" if k["cached"] else "built now", f"runs {k['isa']}"]
            facts.append("on PyTorch's OpenMP threads" if k["openmp"] else "on its own threads")
            facts.append(f"reads {', '.join(k['dtypes'])}")
    elif "importable" in k:  # Triton
        facts = [f"version {k['version'] or 'none'}", f"CUDA {'yes' if k['cuda'] else 'no'}"]
    else:
        facts = ["in this torch" if k["torch_has_it"] else "not in this torch"]
        if k["compiles"] is None and k["torch_has_it"]:
            facts.append("compile not tried (selfattn info --probe)")
    return "; ".join(facts + ([k["why_not"]] if k["why_not"] else []))
