"""lm-evaluation-harness scores a multiple-choice task through ``selfattn serve``.

``selfattn serve`` (a real process, fp32) serves a tiny random Llama saved by transformers with a
local tokenizer; lm_eval's ``local-completions`` model (echo + logprobs + ``max_tokens: 1``, the
way lm_eval scores continuations over an OpenAI-style API) and its ``hf`` model on the same
folder run one custom task whose data the test writes itself. Every choice's loglikelihood must
agree within 1e-4 relative.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from selfattn.serving.server import wait_until_healthy
from tests._no_extras import PYTHONPATH
from tests._serving_helpers import free_port, save_tiny_llama

# found, not imported: lm_eval's imports take seconds, paid only where the test runs
MISSING = [m for m in ("lm_eval", "tenacity") if importlib.util.find_spec(m) is None]

START_TIMEOUT_S = 60  # a fresh interpreter imports torch and loads the model
REL = 1e-4  # per-choice loglikelihood, served vs lm_eval's hf model (both fp32)
ROWS = [  # context, choices, answer: choices of one to three words, contexts of one to four
    {"ctx": "w5 w9 w17", "choices": ["w3", "w22 w40", "w7"], "label": 0},
    {"ctx": "w12 w8", "choices": ["w30 w31 w2", "w11"], "label": 1},
    {"ctx": "w44", "choices": ["w50", "w51", "w52 w53"], "label": 2},
    {"ctx": "w4 w19 w27 w33", "choices": ["w6 w6", "w60"], "label": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow  # a fresh interpreter and lm_eval's imports: ~20 s
@pytest.mark.skipif(bool(MISSING), reason="lm-evaluation-harness is not installed: pip install "
                    "'lm-eval[api]'")  # fmt: skip
def test_lm_eval_loglikelihoods_through_the_server_equal_its_hf_model(tmp_path):
    folder = save_tiny_llama(tmp_path / "tiny")
    port = free_port()
    argv = [sys.executable, "-m", "selfattn", "serve", str(folder), "--port", str(port),
            "--served-model-name", "tiny", "--dtype", "float32",
            "--kv-cache-bytes", str(1 << 20)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        import lm_eval  # while the server starts
        from lm_eval.tasks import TaskManager

        data = tmp_path / "tiny_mc.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
        tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
        wait_until_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S, proc)
        api = {"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": "tiny",
               "tokenizer_backend": "huggingface", "tokenizer": str(folder),
               "tokenized_requests": True, "max_retries": 1,
               "timeout": START_TIMEOUT_S}  # fmt: skip
        hf = {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}
        results = {}
        for name, args in (("local-completions", api), ("hf", hf)):
            results[name] = lm_eval.simple_evaluate(
                model=name, model_args=args, tasks=["tiny_mc"], task_manager=tasks,
                batch_size=16, log_samples=True, bootstrap_iters=0,
            )  # fmt: skip
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    served, theirs = (results[n]["samples"]["tiny_mc"] for n in ("local-completions", "hf"))
    assert len(served) == len(theirs) == len(ROWS)
    for ours, ref in zip(served, theirs):
        assert ours["doc"] == ref["doc"]
        got = [r[0][0] for r in ours["resps"]]
        want = [r[0][0] for r in ref["resps"]]
        assert len(got) == len(ref["doc"]["choices"])
        assert got == pytest.approx(want, rel=REL), err
    acc = [results[n]["results"]["tiny_mc"]["acc,none"] for n in ("local-completions", "hf")]
    assert acc[0] == acc[1]
