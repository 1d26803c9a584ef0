"""Encoder–decoder models with cross-attention: T5 (relative position bias) and BART.

Both are built from :mod:`selfattn.nn` parts: :class:`~selfattn.nn.EncoderBlock` /
:class:`~selfattn.nn.DecoderBlock` around :class:`~selfattn.nn.MultiHeadAttention` (separate
projections, cross-attention through ``context=``). They load transformers checkpoints through
:func:`selfattn.models.from_pretrained` (``model_type`` ``"t5"``, ``"mt5"``, ``"bart"``).

Protocol (what :func:`selfattn.models.generate` drives)::

    model.is_encoder_decoder                      # True
    memory = model.encode(input_ids (B, Se), attention_mask=None)          # (B, Se, d_model)
    cache = model.make_cache("static", B, max_len, dtype=None, page_size=16)
    logits = model.decode(decoder_input_ids (B, S), memory,
                          encoder_attention_mask=None, cache=None)         # (B, S, vocab)
    logits = model(input_ids, attention_mask=None, decoder_input_ids=...)  # full forward
    model.decoder_start_token_id, model.eos_token_id, model.pad_token_id

``attention_mask`` / ``encoder_attention_mask`` are ``(B, Se)`` with 1 (True) at real tokens and
0 at padding, on either side. ``cache`` is a :class:`Seq2SeqCaches` holding the decoder
self-attention K/V (``"static"``: a :class:`~selfattn.cache.StaticCache` per layer, ``"paged"``:
one :class:`~selfattn.cache.PagedKV` for all decoder layers), planned once per step.
A step with a cache appends its tokens after the cached ones: prefill with the start token, then
feed one token per step::

    decoder step t   cache before   query position   sees decoder keys
    prefill [start]  0              0                0
    token 1          1              1                0 1
    token 2          2              2                0 1 2

The cache also memoises each layer's cross-attention K/V, projected from ``memory`` at the first
step that sees it (and again if a different or modified ``memory`` comes): decoding then costs
no projection of the encoder output per step, as in transformers' ``EncoderDecoderCache``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validate import int_at_least
from selfattn.cache import PagedKV, StaticCache
from selfattn.cache.base import Step
from selfattn.cache.layers import LayerCaches
from selfattn.functional import attention
from selfattn.models.hub import CheckpointError, missing_key, register, unsupported
from selfattn.models.masking import padding_mask
from selfattn.nn import MLP, DecoderBlock, EncoderBlock, LayerNorm, MultiHeadAttention, RMSNorm
from selfattn.nn.attention import gate_heads
from selfattn.nn.mlp import ACTIVATIONS, SwiGLU
from selfattn.positions import LearnedPositions
from selfattn.scores import RelativePositionBias

__all__ = ["T5", "Bart", "CrossAttention", "Seq2SeqCaches"]


class CrossAttention(MultiHeadAttention):
    """:class:`~selfattn.nn.MultiHeadAttention` (separate projections) whose ``context`` may come
    pre-projected: ``memory (B, Se, kdim)`` as usual, or the pair :meth:`project_memory` returns,
    which a decode loop computes once per generation instead of once per step.
    """

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``memory (B, Se, kdim)`` -> ``(k (B, Hkv, Se, D), v (B, Hkv, Se, Dv))``."""
        B, Se, _ = memory.shape
        k = self.k_proj(memory).view(B, Se, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(memory).view(B, Se, self.n_kv_heads, -1).transpose(1, 2)
        return k, v  # (B, Se, Hkv·D) -> (B, Hkv, Se, D)

    def forward(self, x: torch.Tensor, context=None, *, mask=None, **kwargs):
        if not isinstance(context, tuple):
            return super().forward(x, context, mask=mask, **kwargs)
        k, v = context
        B, Sq, _ = x.shape
        q = self.q_proj(x).view(B, Sq, self.n_heads, -1).transpose(1, 2)  # (B, Hq, Sq, D)
        p = self.dropout if self.training else 0.0
        out = attention(q, k, v, mask=mask, scale=self.scale, dropout_p=p, backend=self.backend)
        head_mask = kwargs.get("head_mask")
        out = gate_heads(out, self.head_mask if head_mask is None else head_mask)
        out = out.transpose(1, 2).reshape(B, Sq, -1)  # (B, Hq, Sq, Dv) -> (B, Sq, Hq·Dv)
        return self.out_proj(out)


class Seq2SeqCaches:
    """The decoder's self-attention cache plus the memoised cross-attention K/V.

    ``self_attention`` is a model cache (:class:`~selfattn.cache.base.ModelKVCache`): a
    :class:`~selfattn.cache.layers.LayerCaches` of static caches, or a view of one
    :class:`~selfattn.cache.PagedKV` for all decoder layers; ``plan``, ``length`` and ``layers``
    (static only) are its own. ``cross_kv(decoder_layers, memory)`` returns each layer's
    projected ``memory``, recomputing it only when ``memory`` is another tensor or was modified
    in place since (its version counter). ``reset()`` forgets both.
    """

    def __init__(self, kind: str, self_attention):
        self.kind, self.self_attention = kind, self_attention
        self._memory, self._version, self._cross = None, None, None

    @property
    def layers(self) -> list:
        return self.self_attention.layers

    @property
    def n_layers(self) -> int:
        return self.self_attention.n_layers

    @property
    def length(self) -> int:
        return self.self_attention.length

    def __len__(self) -> int:
        return self.length

    def plan(self, n_tokens: int) -> Step:
        return self.self_attention.plan(n_tokens)

    def cross_kv(self, decoder: nn.ModuleList, memory: torch.Tensor) -> list:
        if self._memory is not memory or self._version != memory._version:
            self._cross = [layer.cross_attention.project_memory(memory) for layer in decoder]
            self._memory, self._version = memory, memory._version
        return self._cross

    def reset(self) -> None:
        self.self_attention.reset()
        self._memory, self._version, self._cross = None, None, None


# -- config reading --------------------------------------------------------------------------------
def _int(config: Mapping, key: str, default=None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise missing_key(config, key)
    return int_at_least(value, f"config {key} ({config.get('model_type', '?')})", minimum)


def _key_mask(attention_mask, B: int, Se: int, name: str):
    """The key mask of a 1/0 ``attention_mask (B, Se)`` over the encoder tokens (None: none)."""
    return (
        None
        if attention_mask is None
        else padding_mask(attention_mask, B, Se, name=name, length="Se")
    )


def _activation(config: Mapping, key: str, name: str):
    if name not in ACTIVATIONS:
        raise unsupported(config, key, f"activation {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _rename(state: Mapping[str, torch.Tensor], rules) -> dict[str, torch.Tensor]:
    """Rename each tensor by the first ``(pattern, replacement)`` whose pattern matches the start
    of its name (the unmatched tail is kept); a ``None`` replacement drops the tensor.

    Names no rule matches pass through, so ``load_state`` reports them as unexpected.
    """
    out = {}
    for name, t in state.items():
        for pattern, repl in rules:
            m = re.match(pattern, name)
            if m:
                name = None if repl is None else m.expand(repl) + name[m.end() :]
                break
        if name is not None:
            out[name] = t
    return out


# -- the shared encoder-decoder protocol -----------------------------------------------------------
class _EncoderDecoder(nn.Module):
    """``encode`` / ``decode`` / ``make_cache`` / ``forward`` over ``self.encoder`` and
    ``self.decoder`` (``ModuleList`` s of blocks); subclasses embed and project to logits."""

    is_encoder_decoder = True

    def _embed_encoder(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _embed_decoder(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def _encoder_out(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    encoder_score_mod = decoder_score_mod = None

    def _check_ids(self, ids, name: str) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be an integer tensor (B, S), got {got}")
        if not ids.numel():
            return
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one device sync per call
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(
                f"{name} holds token ids {lo}..{hi} outside the vocabulary 0..{self.vocab_size - 1}"
            )

    def encode(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """``input_ids (B, Se)``, ``attention_mask (B, Se)`` -> ``memory (B, Se, d_model)``."""
        self._check_ids(input_ids, "input_ids")
        mask = _key_mask(attention_mask, *input_ids.shape, "attention_mask")
        h = self._embed_encoder(input_ids)
        for layer in self.encoder:
            h = layer(h, mask=mask, score_mod=self.encoder_score_mod)
        return self._encoder_out(h)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        *,
        encoder_attention_mask=None,
        cache=None,
    ) -> torch.Tensor:
        """``decoder_input_ids (B, S)`` attending to ``memory (B, Se, d_model)`` -> logits
        ``(B, S, vocab)``. With ``cache`` (from :meth:`make_cache`) the tokens follow the cached
        ones and their K/V are appended."""
        self._check_ids(decoder_input_ids, "decoder_input_ids")
        B = decoder_input_ids.shape[0]
        if memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != self.d_model:
            raise ValueError(
                f"memory must be (B={B}, Se, d_model={self.d_model}) from encode(), got "
                f"{tuple(memory.shape)}"
            )
        context_mask = _key_mask(
            encoder_attention_mask, B, memory.shape[1], "encoder_attention_mask"
        )
        if isinstance(cache, (list, tuple)):  # the layers' own caches, one per decoder layer
            cache = LayerCaches("layers", list(cache))
        if cache is not None and cache.n_layers != len(self.decoder):
            raise ValueError(
                f"cache has {cache.n_layers} layer caches but the decoder has "
                f"{len(self.decoder)} layers; build it with model.make_cache(...)"
            )
        start = 0 if cache is None else cache.length
        step = None if cache is None else cache.plan(decoder_input_ids.shape[1])  # once
        contexts = [memory] * len(self.decoder)
        if isinstance(cache, Seq2SeqCaches):
            contexts = cache.cross_kv(self.decoder, memory)
        h = self._embed_decoder(decoder_input_ids, start)
        layer_caches = [None] * len(self.decoder) if step is None else step.layers
        for layer, context, layer_cache in zip(self.decoder, contexts, layer_caches):
            h = layer(
                h,
                context,
                context_mask=context_mask,
                score_mod=self.decoder_score_mod,
                cache=layer_cache,
            )
        return self._logits(h)

    def forward(
        self, input_ids: torch.Tensor, attention_mask=None, *, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        """Full forward: ``input_ids (B, Se)``, ``decoder_input_ids (B, S)`` -> logits
        ``(B, S, vocab)``."""
        memory = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, memory, encoder_attention_mask=attention_mask)

    def make_cache(
        self, kind: str, batch: int, max_len: int, *, dtype=None, page_size: int = 16
    ) -> Seq2SeqCaches:
        """The decoder's self-attention cache for ``batch`` sequences of ``max_len`` decoder
        tokens: ``"static"`` (a :class:`StaticCache` per layer) or ``"paged"`` (one
        :class:`PagedKV` of ``page_size``-token pages for all decoder layers, viewed over
        ``batch`` fresh sequences)."""
        ref = self.decoder[0].self_attention
        dtype = ref.out_proj.weight.dtype if dtype is None else dtype
        fk = {"dtype": dtype, "device": ref.out_proj.weight.device}
        dims = (ref.n_kv_heads, ref.head_dim)
        if kind == "static":
            caches = [StaticCache(batch, max_len, *dims, **fk) for _ in self.decoder]
            return Seq2SeqCaches(kind, LayerCaches(kind, caches, fk["device"]))
        if kind == "paged":
            pages = -(-max_len // page_size)
            kv = PagedKV(
                len(self.decoder), batch * pages, page_size, *dims, max_seqs=batch,
                max_pages_per_seq=pages, **fk,
            )  # fmt: skip
            return Seq2SeqCaches(kind, kv.view(kv.add_sequences(batch)))
        raise ValueError(
            f"cache kind must be 'static' or 'paged', got {kind!r}: the decoder has no "
            "sliding-window layers"
        )


def _token_ids(config: Mapping) -> dict:
    """The special token ids generation needs (T5 starts decoding from its pad token)."""
    pad = config.get("pad_token_id")
    return {
        "decoder_start_token_id": config.get("decoder_start_token_id", pad),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": pad,
    }


# -- T5 --------------------------------------------------------------------------------------------
@register("t5", "mt5")
class T5(_EncoderDecoder):
    """T5 (Raffel et al., 2020) and T5 v1.1 / mT5: pre-norm blocks with an RMS norm, unscaled
    scores plus a learned relative-position bias (bidirectional buckets in the encoder, causal in
    the decoder) computed once per stack and shared by its layers, ReLU or gated-GELU
    feed-forward, one embedding for both stacks.

    The output head is the shared embedding when ``tied`` (logits of ``h · d_model^-0.5`` when
    ``scale_output``, original T5) or a separate ``lm_head`` (T5 v1.1 checkpoints that untie).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        d_kv: int,
        d_ff: int,
        num_heads: int,
        num_layers: int,
        num_decoder_layers: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        activation=F.relu,
        gated: bool = False,
        eps: float = 1e-6,
        dropout: float = 0.0,
        tied: bool = True,
        scale_output: bool = True,
        decoder_start_token_id: int | None = 0,
        eos_token_id: int | None = 1,
        pad_token_id: int | None = 0,
    ):
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.decoder_start_token_id = decoder_start_token_id
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.scale_output = scale_output
        self.shared = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)

        def attention(cls=MultiHeadAttention):
            # T5 folds 1/sqrt(D) into its initialisation, so scores are not scaled (scale=1).
            return cls(
                d_model,
                num_heads,
                head_dim=d_kv,
                fused=False,
                bias=False,
                scale=1.0,
                dropout=dropout,
            )

        def mlp():
            if gated:
                return SwiGLU(d_model, d_ff, activation=activation, dropout=dropout)
            return MLP(d_model, d_ff, bias=False, dropout=dropout, activation=activation)

        def norm():
            return RMSNorm(d_model, eps)

        self.encoder = nn.ModuleList(
            EncoderBlock(attention(), mlp(), norm(), norm(), dropout=dropout)
            for _ in range(num_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderBlock(
                attention(),
                mlp(),
                norm(),
                norm(),
                cross_attention=attention(CrossAttention),
                cross_norm=norm(),
                dropout=dropout,
            )
            for _ in range(num_decoder_layers)
        )
        # Layer 0 of each stack owns the table in T5; every layer adds the same bias.
        self.encoder_bias = RelativePositionBias(num_heads, num_buckets, max_distance, True)
        self.decoder_bias = RelativePositionBias(num_heads, num_buckets, max_distance, False)
        self.encoder_norm, self.decoder_norm = norm(), norm()
        self.lm_head = None if tied else nn.Linear(d_model, vocab_size, bias=False)

    @property
    def encoder_score_mod(self):
        return self.encoder_bias

    @property
    def decoder_score_mod(self):
        return self.decoder_bias

    def _embed_encoder(self, input_ids):
        return self.dropout(self.shared(input_ids))  # (B, Se) -> (B, Se, d_model)

    def _embed_decoder(self, input_ids, start):
        return self.dropout(self.shared(input_ids))  # (B, S) -> (B, S, d_model)

    def _encoder_out(self, h):
        return self.dropout(self.encoder_norm(h))

    def _logits(self, h):
        h = self.dropout(self.decoder_norm(h))
        if self.lm_head is not None:
            return self.lm_head(h)  # (B, S, d_model) -> (B, S, vocab)
        if self.scale_output:
            h = h * self.d_model**-0.5  # Mesh TensorFlow rescales before the tied projection
        return F.linear(h, self.shared.weight)  # (B, S, d_model) -> (B, S, vocab)

    @classmethod
    def from_config(cls, config: Mapping) -> T5:
        """A T5 from a transformers ``T5Config`` dict (``feed_forward_proj`` ``"relu"``,
        ``"gated-gelu"`` or ``[gated-]{relu,gelu,gelu_new,silu}``)."""
        proj = config.get("feed_forward_proj", "relu")
        gated = isinstance(proj, str) and proj.startswith("gated-")
        act_name = proj[len("gated-") :] if gated else proj
        if gated and act_name == "gelu":
            act_name = "gelu_new"  # transformers' backward-compatible meaning of "gated-gelu"
        activation = _activation(config, "feed_forward_proj", act_name)
        if config.get("is_decoder"):
            raise unsupported(config, "is_decoder", "this is the encoder-decoder model")
        num_layers = _int(config, "num_layers")
        # transformers >= 5 writes scale_decoder_outputs and always ties; older configs say
        # tie_word_embeddings=False for T5 v1.1 (separate lm_head, no rescale). mT5 never rescales.
        tied = config.get("tie_word_embeddings", True) is not False
        scale = config.get("scale_decoder_outputs", tied) and config.get("model_type") != "mt5"
        return cls(
            vocab_size=_int(config, "vocab_size"),
            d_model=_int(config, "d_model"),
            d_kv=_int(config, "d_kv"),
            d_ff=_int(config, "d_ff"),
            num_heads=_int(config, "num_heads"),
            num_layers=num_layers,
            num_decoder_layers=_int(config, "num_decoder_layers", num_layers),
            num_buckets=_int(config, "relative_attention_num_buckets", 32),
            max_distance=_int(config, "relative_attention_max_distance", 128),
            activation=activation,
            gated=gated,
            eps=float(config.get("layer_norm_epsilon", 1e-6)),
            dropout=float(config.get("dropout_rate", 0.0)),
            tied=tied,
            scale_output=bool(scale),
            **_token_ids(config),
        )

    def convert_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' ``T5ForConditionalGeneration`` names -> this module's."""
        _check_tied(self, state, "shared.weight")
        ffn = ("wi", "wo") if isinstance(self.encoder[0].mlp, MLP) else ("wi_0", "wi_1", "wo")
        ffn = dict(zip(ffn, ("fc1", "fc2") if len(ffn) == 2 else ("gate", "up", "down")))
        attn = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
        # (stack, T5 sublayer index, its module name) -> our block's attention and norm names
        sublayers = {
            ("encoder", 0, "SelfAttention"): ("attention", "attn_res"),
            ("encoder", 1, "DenseReluDense"): ("mlp", "mlp_res"),
            ("decoder", 0, "SelfAttention"): ("self_attention", "self_res"),
            ("decoder", 1, "EncDecAttention"): ("cross_attention", "cross_res"),
            ("decoder", 2, "DenseReluDense"): ("mlp", "mlp_res"),
        }
        bias = r"block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\."
        rules = [
            (r"(encoder|decoder)\.embed_tokens\.weight$", None),  # copies of shared.weight
            (r"lm_head\.weight$", None if self.lm_head is None else "lm_head.weight"),
            (rf"(encoder|decoder)\.{bias}", r"\1_bias."),
            # transformers creates but never uses a cross-attention table
            (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.", None),
            (r"(encoder|decoder)\.final_layer_norm\.", r"\1_norm."),
        ]
        for (stack, i, hf), (module, residual) in sublayers.items():
            layer = rf"{stack}\.block\.(\d+)\.layer\.{i}\."
            rules.append((layer + r"layer_norm\.", rf"{stack}.\1.{residual}.norm."))
            names = ffn if hf == "DenseReluDense" else attn
            rules += [
                (rf"{layer}{hf}\.{a}\.", rf"{stack}.\1.{module}.{b}.") for a, b in names.items()
            ]
        return _rename(state, rules)


def _check_tied(model, state: Mapping[str, torch.Tensor], embedding: str) -> None:
    """A tied model drops ``lm_head.weight``; refuse to when it is not the embedding's copy."""
    if model.lm_head is not None or "lm_head.weight" not in state or embedding not in state:
        return
    if not torch.equal(state["lm_head.weight"], state[embedding]):
        raise CheckpointError(
            "the config ties lm_head to the shared embedding (tie_word_embeddings=True) but the "
            f"checkpoint's lm_head.weight differs from {embedding}; set "
            '"tie_word_embeddings": false in config.json'
        )


# -- BART ------------------------------------------------------------------------------------------
# BART's position table has two extra leading rows (a fairseq padding-index leftover): position p
# reads row p + 2.
_BART_POSITION_OFFSET = 2


@register("bart")
class Bart(_EncoderDecoder):
    """BART (Lewis et al., 2020): post-norm LayerNorm blocks with biased projections and scaled
    scores, learned absolute positions (offset by two rows) plus an embedding LayerNorm in each
    stack, token embeddings optionally scaled by ``sqrt(d_model)``, and an output head tied to
    the shared embedding plus a ``final_logits_bias``. Untied (``tie_word_embeddings=False``),
    transformers gives each stack its own token table and the head its own weight; so does this.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        encoder_layers: int,
        decoder_layers: int,
        encoder_heads: int,
        decoder_heads: int,
        encoder_ffn_dim: int,
        decoder_ffn_dim: int,
        max_positions: int,
        activation=F.gelu,
        scale_embedding: bool = False,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        tied: bool = True,
        decoder_start_token_id: int | None = 2,
        eos_token_id: int | None = 2,
        pad_token_id: int | None = 1,
    ):
        super().__init__()
        self.vocab_size, self.d_model, self.max_positions = vocab_size, d_model, max_positions
        self.decoder_start_token_id = decoder_start_token_id
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.embed_scale = math.sqrt(d_model) if scale_embedding else 1.0
        if tied:
            self.shared = nn.Embedding(vocab_size, d_model)
            self.lm_head = None
        else:
            self.encoder_tokens = nn.Embedding(vocab_size, d_model)
            self.decoder_tokens = nn.Embedding(vocab_size, d_model)
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.dropout = nn.Dropout(dropout)

        def attention(heads, cls=MultiHeadAttention):
            return cls(d_model, heads, fused=False, dropout=attention_dropout)

        def mlp(d_ff):
            return MLP(d_model, d_ff, dropout=activation_dropout, activation=activation)

        self.encoder = nn.ModuleList(
            EncoderBlock(
                attention(encoder_heads),
                mlp(encoder_ffn_dim),
                LayerNorm(d_model),
                LayerNorm(d_model),
                norm_first=False,
                dropout=dropout,
            )
            for _ in range(encoder_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderBlock(
                attention(decoder_heads),
                mlp(decoder_ffn_dim),
                LayerNorm(d_model),
                LayerNorm(d_model),
                cross_attention=attention(decoder_heads, CrossAttention),
                cross_norm=LayerNorm(d_model),
                norm_first=False,
                dropout=dropout,
            )
            for _ in range(decoder_layers)
        )
        rows = max_positions + _BART_POSITION_OFFSET
        self.encoder_positions = LearnedPositions(rows, d_model)
        self.decoder_positions = LearnedPositions(rows, d_model)
        self.encoder_embed_norm, self.decoder_embed_norm = LayerNorm(d_model), LayerNorm(d_model)
        self.register_buffer("final_logits_bias", torch.zeros(vocab_size))

    def _embed(self, input_ids, start, tokens: nn.Embedding, positions, norm: nn.Module):
        S = input_ids.shape[1]
        if start + S > self.max_positions:
            raise ValueError(
                f"BART has max_position_embeddings={self.max_positions} but positions "
                f"{start}..{start + S - 1} were asked for; shorten the input"
            )
        pos = torch.arange(start, start + S, device=input_ids.device) + _BART_POSITION_OFFSET
        h = tokens(input_ids) * self.embed_scale + positions(pos)  # (B, S) -> (B, S, d)
        return self.dropout(norm(h))

    def _embed_encoder(self, input_ids):
        tokens = self.shared if self.lm_head is None else self.encoder_tokens
        return self._embed(input_ids, 0, tokens, self.encoder_positions, self.encoder_embed_norm)

    def _embed_decoder(self, input_ids, start):
        tokens = self.shared if self.lm_head is None else self.decoder_tokens
        return self._embed(
            input_ids, start, tokens, self.decoder_positions, self.decoder_embed_norm
        )

    def _logits(self, h):
        w = self.shared.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w) + self.final_logits_bias  # (B, S, d_model) -> (B, S, vocab)

    @classmethod
    def from_config(cls, config: Mapping) -> Bart:
        """A BART from a transformers ``BartConfig`` dict."""
        for key in ("normalize_before", "add_final_layer_norm"):  # mBART-style pre-norm
            if config.get(key):
                raise unsupported(config, key, "only BART's post-norm layout is implemented")
        act = config.get("activation_function", "gelu")
        return cls(
            vocab_size=_int(config, "vocab_size"),
            d_model=_int(config, "d_model"),
            encoder_layers=_int(config, "encoder_layers"),
            decoder_layers=_int(config, "decoder_layers"),
            encoder_heads=_int(config, "encoder_attention_heads"),
            decoder_heads=_int(config, "decoder_attention_heads"),
            encoder_ffn_dim=_int(config, "encoder_ffn_dim"),
            decoder_ffn_dim=_int(config, "decoder_ffn_dim"),
            max_positions=_int(config, "max_position_embeddings"),
            activation=_activation(config, "activation_function", act),
            scale_embedding=bool(config.get("scale_embedding", False)),
            dropout=float(config.get("dropout", 0.0)),
            attention_dropout=float(config.get("attention_dropout", 0.0)),
            activation_dropout=float(config.get("activation_dropout", 0.0)),
            tied=config.get("tie_word_embeddings", True) is not False,
            **_token_ids(config),
        )

    def convert_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' ``BartForConditionalGeneration`` names -> this module's."""
        _check_tied(self, state, "model.shared.weight")
        state = dict(state)
        if "final_logits_bias" in state:
            state["final_logits_bias"] = state["final_logits_bias"].reshape(-1)  # (1, V) -> (V,)
        else:
            state["final_logits_bias"] = torch.zeros(self.vocab_size)  # optional in transformers
        tied = self.lm_head is None
        rules = [
            # tied: copies of shared; untied: each stack's own table (shared is unused)
            (r"model\.(encoder|decoder)\.embed_tokens\.", None if tied else r"\1_tokens."),
            (r"lm_head\.weight$", None if tied else "lm_head.weight"),
            (r"model\.shared\.", "shared." if tied else None),
            (r"model\.(encoder|decoder)\.embed_positions\.", r"\1_positions."),
            (r"model\.(encoder|decoder)\.layernorm_embedding\.", r"\1_embed_norm."),
        ]
        layers = {
            "encoder": {
                "self_attn": "attention",
                "self_attn_layer_norm": "attn_res.norm",
                "final_layer_norm": "mlp_res.norm",
                "fc1": "mlp.fc1",
                "fc2": "mlp.fc2",
            },
            "decoder": {
                "self_attn": "self_attention",
                "self_attn_layer_norm": "self_res.norm",
                "encoder_attn": "cross_attention",
                "encoder_attn_layer_norm": "cross_res.norm",
                "final_layer_norm": "mlp_res.norm",
                "fc1": "mlp.fc1",
                "fc2": "mlp.fc2",
            },
        }
        for stack, names in layers.items():
            rules += [
                (rf"model\.{stack}\.layers\.(\d+)\.{hf}\.", rf"{stack}.\1.{ours}.")
                for hf, ours in names.items()
            ]
        return _rename(state, rules)
