"""The tiny Llama the server tests serve: its folder, model and tokenizer, built once per module
(a module defining its own ``folder`` serves another checkpoint)."""

from __future__ import annotations

import pytest

from tests._serving_helpers import save_tiny_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def model(folder):
    from selfattn.models import from_pretrained

    return from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def tokenizer(folder):
    from selfattn.models import load_tokenizer

    return load_tokenizer(folder)
