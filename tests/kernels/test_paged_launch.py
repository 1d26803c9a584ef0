"""paged_decode.Launch: a planned step's kernel arguments built once, then per layer only the
pointers set; the same results as decode()."""

from __future__ import annotations

import pytest
import torch

from selfattn import masks
from selfattn.backends.paged._intervals import key_intervals
from selfattn.kernels import paged_decode
from tests.cache.test_paged import make_paged

pytestmark = pytest.mark.c_kernel(paged_decode)


@pytest.mark.parametrize("Sq, sinks", [(1, False), (3, True)])
def test_launch_equals_decode_for_every_layer(Sq, sinks):
    lens = [13, 6, 29]
    q, kp, vp, table, seq_lens = make_paged(lens, 6, 2, D=8, P=4, Sq=Sq, seed=Sq)
    lo, hi = key_intervals(masks.causal() & masks.sliding_window(9), seq_lens.long(), Sq)
    splits = paged_decode.key_splits(lo, hi, 4)
    launch = paged_decode.Launch(q, kp, vp, table, lo, hi, splits)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):  # other pages and queries of the same layout, as a step's layers
        q2 = torch.randn(q.shape, generator=g)
        kp2, vp2 = torch.randn(kp.shape, generator=g), torch.randn(vp.shape, generator=g)
        s = torch.randn(6, generator=g) if sinks else None
        assert launch.fits(q2, kp2, vp2)
        got = launch(q2, kp2, vp2, 0.3, s)
        want = paged_decode.decode(q2, kp2, vp2, table, lo, hi, 0.3, None, None, s, splits)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert not launch.fits(q[:, :3], kp, vp)  # another layout: decode() serves it
    assert not launch.fits(q, kp[:-1], vp)
