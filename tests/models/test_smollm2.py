"""The bundled SmolLM2-135M-Instruct GGUF against transformers' own GGUF loader: chat answers.

transformers reads the file with its GGUF integration (``from_pretrained(folder, gguf_file=...)``,
which dequantises every weight to float32 and undoes llama.cpp's Q/K permutation itself): an
implementation independent of ours. Each chat prompt is rendered with our tokenizer's chat
template and decoded greedily by both models in float32; the answers must be the same tokens, and
ours must stop where the model says (``<|im_end|>``) without being told.
"""

from __future__ import annotations

import pytest
import torch

from selfattn.models import from_pretrained, generate, load_tokenizer
from tests._gguf_helpers import smollm2_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

# a short answer that ends at the end of turn, prose, and code
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fib(n):  # complete this Python function",
]
NEW = 40


@pytest.fixture(scope="module")
def models():
    path = smollm2_path()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    peer = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = from_pretrained(path, dtype=torch.float32, quantized=False)
    return ours, peer, load_tokenizer(path)


@pytest.mark.slow  # transformers' GGUF loader reads the vocabulary in Python: ~15 s
def test_greedy_chat_answers_equal_transformers(models):
    ours, peer, tokenizer = models
    stopped = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True)])
        with torch.inference_mode():
            got = generate(ours, ids, NEW)[0, ids.shape[1] :].tolist()
            want = peer.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1] :]
        want = want.tolist()
        assert got == want[: len(got)], (prompt, tokenizer.decode(got), tokenizer.decode(want))
        if len(got) < NEW:  # stopped early: at the model's end of turn, as transformers did
            stopped += 1
            assert got[-1] in tokenizer.stop_token_ids and got == want, prompt
    assert stopped, "no answer ended before the token budget: the stop test checked nothing"
