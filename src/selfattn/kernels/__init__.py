"""Kernels: C and Triton sources as files, each exposed as a ``torch.library`` custom op with a
fake implementation (:mod:`selfattn.kernels.ops`), each with a plain-PyTorch twin beside it.

- ``csrc/paged_decode.c`` + :mod:`~selfattn.kernels.paged_decode`: paged decode on CPU.
- ``csrc/fused_attention.c`` + :mod:`~selfattn.kernels.fused_attention`: dense attention on CPU
  over a mask's tiles, forward and backward (its twin: ``fused_attention.twin``).
- :mod:`~selfattn.kernels.triton.paged`: paged decode on CUDA (flash-decoding splits).
- :mod:`~selfattn.kernels.paged_twin`: the twin of both.
- :mod:`~selfattn.kernels.build`: C build specs as data, the per-user build cache, trusted loads.

The lowest layer: kernels import torch, the standard library and (lazily) Triton, never another
part of selfattn; backends call them. Importing this package builds and probes nothing.
"""
