"""``models.masking.padding_mask``: transformers' 1/0 ``attention_mask`` as one selfattn mask for
every model family (encoder, decoder, seq2seq): the cheapest exact form per padding pattern."""

from __future__ import annotations

import zlib

import pytest
import torch

from selfattn.models.masking import padding_mask

B, S = 3, 11  # odd sizes


def _pattern(kind: str, gen: torch.Generator) -> torch.Tensor:
    n = torch.randint(1, S, (B,), generator=gen)
    cols = torch.arange(S)
    if kind == "right":
        keep = cols < n[:, None]
    elif kind == "left":
        keep = cols >= (S - n)[:, None]
    elif kind == "holes":
        keep = torch.rand(B, S, generator=gen) < 0.6
        keep[:, 0], keep[:, 1], keep[:, -1] = True, False, True  # neither left nor right padded
    else:
        keep = torch.ones(B, S, dtype=torch.bool)
    return keep.long()  # transformers' 1/0 ints


@pytest.mark.parametrize(
    "kind, form",
    [("full", None), ("right", "padding("), ("left", "~padding("), ("holes", "from_tensor")],
)
@pytest.mark.parametrize("Sq", [1, S])
def test_each_pattern_gets_its_analytic_form_and_hides_exactly_the_padding(kind, form, Sq):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind} {Sq}".encode()))
    am = _pattern(kind, gen)
    mask = padding_mask(am, B, S)
    if form is None:
        assert mask is None
        return
    assert repr(mask).startswith(form)
    assert mask.analytic == (kind != "holes")  # tile-skipping backends skip padding tiles
    dense = mask.to_dense(Sq, S, B=B)  # (B, 1, Sq, S): every query row sees the same keys
    want = am.bool()[:, None, None, :].expand(B, 1, Sq, S)
    assert torch.equal(dense, want), f"{kind}: {mask!r}"


def test_right_padding_can_let_padded_queries_see_padding():
    """Encoders: token rows see the tokens, padded rows only the padding (no empty row)."""
    gen = torch.Generator().manual_seed(5)
    keep = _pattern("right", gen).bool()
    dense = padding_mask(keep.long(), B, S, padded_queries_see_padding=True).to_dense(S, S, B=B)
    for b in range(B):
        rows = keep[b][:, None] == keep[b][None, :]  # same side of the padding boundary
        assert torch.equal(dense[b, 0], rows)
    # other patterns stay key masks
    holes = _pattern("holes", gen)
    dense = padding_mask(holes, B, S, padded_queries_see_padding=True).to_dense(S, S, B=B)
    assert torch.equal(dense, holes.bool()[:, None, None, :].expand(B, 1, S, S))


def test_wrong_shape_names_the_argument_and_both_shapes():
    am = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"encoder_attention_mask must be \(B=2, Se=5\).*\(2, 4\)"):
        padding_mask(am, 2, 5, name="encoder_attention_mask", length="Se")
    with pytest.raises(ValueError, match=r"attention_mask must be \(B=2, S=4\).*got list"):
        padding_mask([[1, 1, 1, 1]] * 2, 2, 4)
