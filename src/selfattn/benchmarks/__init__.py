"""The benchmarks, shipped with the package so that ``selfattn bench`` runs from an installed
wheel: each module has a ``main(argv)`` and runs as ``python -m selfattn.benchmarks.NAME
[--quick] [--json]``; ``benchmarks/NAME.py`` in a source checkout is a thin entry point to it.

Speed is measured here, never asserted in tests (tests/test_benchmarks_smoke.py checks only that
each runs and that its ratios and verdicts follow from what it measured). Importing this package
imports no benchmark.
"""

# In the order `selfattn bench` runs them; gpu needs a CUDA device.
NAMES = (
    "alternatives",
    "attention",
    "attention_claim",
    "cpu_llm",
    "crossover",
    "decode",
    "decode_step",
    "determinism",
    "gguf_model",
    "gpu",
    "kv_capacity",
    "kv_compression",
    "kv_prefill",
    "layers",
    "lens_parity",
    "mla",
    "models",
    "quant_matmul",
    "ring",
    "schema_fuzz",
    "serving",
    "serving_http",
    "soak",
    "speculative",
    "streaming",
    "structured",
    "variants",
    "view",
)

__all__ = ["NAMES"]
