"""EngineConfig: one statement of each engine default (the Engine, `selfattn serve`'s flags),
its checks naming the value, and the two ways to build an Engine agreeing."""

from __future__ import annotations

import pytest
import torch

from selfattn.serving.config import EngineConfig, ServerLimits

transformers = pytest.importorskip("transformers")

from selfattn.serving import Engine  # noqa: E402
from tests.models.test_models_decoder import tiny_pair  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_pair("llama", tmp_path_factory.mktemp("llama"), seed=5)[1]


def test_serve_flags_default_to_the_config_fields():
    from selfattn.cli.main import build_parser

    args = build_parser().parse_args(["serve", "m"])
    c = EngineConfig()
    got = (args.page_size, args.max_num_seqs, args.max_batch_tokens, args.max_waiting)
    assert got == (c.page_size, c.max_num_seqs, c.max_batch_tokens, c.max_waiting)
    limits = ServerLimits()
    got = (args.max_request_bytes, args.max_connections, args.max_stream_backlog)
    assert got == (limits.max_request_bytes, limits.max_connections, limits.max_stream_backlog)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be a positive int .*got 0"),
        ({"page_size": 2.5}, ValueError, "page_size must be a positive int .*got 2.5"),
        ({"max_model_len": -1}, ValueError, "max_model_len must be a positive int .*got -1"),
        ({"prefix_caching": 1}, TypeError, "prefix_caching must be a bool, got 1"),
        ({"seed": "7"}, TypeError, "seed must be an int, got '7'"),
        ({"admit_quiet_s": -1.0}, ValueError, r"admit_quiet_s must be seconds in \[0, 60\)"),
        ({"admit_window_s": float("inf")}, ValueError, "admit_window_s must be seconds in"),
        ({"kv_dtype": "int8"}, TypeError, "kv_dtype must be None, a float torch.dtype"),
    ],
)
def test_bad_values_are_named(kw, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kw)


def test_replace_names_unknown_fields():
    with pytest.raises(TypeError, match="EngineConfig has no field max_seqs; its fields: "):
        EngineConfig().replace(max_seqs=3)


def test_keywords_and_config_build_the_same_engine(model):
    by_config = Engine(model, config=EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=3))
    by_keywords = Engine(model, kv_cache_bytes=1 << 20, max_num_seqs=3)
    assert by_config.config == by_keywords.config
    assert by_config.scheduler.max_num_seqs == by_keywords.scheduler.max_num_seqs == 3
    # keywords override the config's fields
    both = Engine(model, config=EngineConfig(kv_dtype=torch.int8), max_waiting=5)
    assert (both.config.kv_dtype, both.max_waiting) == (torch.int8, 5)
    with pytest.raises(TypeError, match="EngineConfig has no field max_seq"):
        Engine(model, max_seq=3)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Engine(model, config={"max_num_seqs": 3})
