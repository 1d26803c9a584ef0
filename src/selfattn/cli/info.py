"""``selfattn info``: versions, device, and which registered backends run here
(:func:`selfattn.inspect.backend_availability`)."""

from __future__ import annotations

import os
import platform

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "info",
        help="versions, device and registered backends",
        description="Print versions (selfattn, torch, python, triton), device and backends.",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)
    return p


def _version_of(dist: str) -> str | None:
    import importlib.metadata  # here, not at the top: it would double the cost of --help

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _info() -> dict:
    import torch

    import selfattn as sa
    from selfattn.inspect.backend_matrix import backend_availability

    cuda = torch.cuda.is_available()
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "versions": {
            "selfattn": sa.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "numpy": _version_of("numpy"),
            "rich": _version_of("rich"),
            "triton": _version_of("triton"),
        },
        "device": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
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
    }


def run(args) -> int:
    info = _info()
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
    return _common.EXIT_OK
