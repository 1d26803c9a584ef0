"""Tensor parallelism: one decoder served across ``N`` processes.

Megatron's split (Shoeybi et al., 2019, arXiv 1909.08053). In every block the q/k/v projection
and the MLP's input projections are column-wise parallel (each rank computes its own heads' q,
k, v and its slice of the hidden units) and the attention's output projection and the MLP's
output projection row-wise parallel (each rank's partial product, summed by one all-reduce,
:class:`ReducedLinear`): two all-reduces per layer, nothing else crosses ranks. The shards are
plain modules (``nn.Linear``, or a quantised checkpoint's
:class:`~selfattn.nn.QuantizedLinear` split on its blocks, never re-quantised), so every rank runs
the blocks' one decode step (:class:`~selfattn.nn.blocks.RowsStep`) as one process does.
Rank ``r`` holds query heads ``r·Hq/N .. (r+1)·Hq/N - 1`` and kv heads ``r·Hkv/N ..`` (a GQA
group never straddles ranks) and their K/V pages in its own :class:`~selfattn.cache.PagedKV`:
``kv_cache_bytes`` is per rank, so N ranks hold about N times the tokens of one. Embeddings,
norms and the LM head are replicated::

    engine = tensor_parallel_engine("path/to/model", 2, tokenizer=tok,
                                    config=EngineConfig(kv_cache_bytes=2**30))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))
    engine.close()                                      # the workers exit

Processes: rank 0 is the calling process and runs the :class:`~selfattn.serving.Engine`
(scheduler, sampling, every page's bookkeeping). Each step it broadcasts the step's token ids,
each sequence's page ids and length and the pages copied on write, then runs its forward; ranks
1..N-1 mirror the pages (the same page ids in their own storage, no allocator) and run the same
forward (their logits go unused). On one machine :func:`tensor_parallel_engine` spawns the N-1
workers itself (gloo on CPU; NCCL with ``device="cuda"``, worker ``r`` on ``cuda:r``) and meets
them over a TCP store on 127.0.0.1.

Across machines, torchrun starts every rank with the same command and its rendezvous
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``);
:func:`tensor_parallel_engine` then joins that group (``env://``) instead of spawning. Rank 0
returns the engine (it serves HTTP); on every other rank the call serves steps until rank 0
closes, then exits the process (``SystemExit(0)``)::

    # on machine A (rank 0, serves), then on machine B with --node-rank 1
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr A --master-port 29500 \\
        -m selfattn serve MODEL_DIR --tensor-parallel 2

Failures: every collective waits at most ``timeout_s`` (the process group's timeout), and rank 0
sends a heartbeat while idle so that waiting workers never reach it. A worker that raises or
dies makes rank 0's step raise :class:`TensorParallelError` naming the rank and its error (not a
hang): the step's requests fail, so does every later step, and the other workers are ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from selfattn.cache import PagedKV
from selfattn.cache.paged.kivi import KIVIPagedKV
from selfattn.kernels.determinism import deterministic
from selfattn.models.decoder import CausalLM
from selfattn.nn import MLP, DiffAttention, MultiHeadAttention, QuantizedLinear, SwiGLU
from selfattn.nn.quant import column_groups
from selfattn.serving.engine import Engine

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ReducedLinear",
    "TensorParallelEngine",
    "TensorParallelError",
    "tensor_parallel",
    "tensor_parallel_engine",
]

# Each collective (and the workers' start) waits at most this long. A worker's first step may
# compile nothing and load nothing: it only waits for rank 0's next step, which the heartbeat
# keeps shorter than this while rank 0 is idle.
DEFAULT_TIMEOUT_S = 120.0
# The workers' start (loading the model, meeting rank 0) may take longer than a step.
DEFAULT_START_TIMEOUT_S = 600.0
HEARTBEATS_PER_TIMEOUT = 4  # an idle rank 0 pings the workers this often per timeout
_POLL_S = 0.05  # rank 0 polls the workers' start at this interval
# Step messages: a fixed header, then (for a step) one int64 payload.
_STEP, _IDLE, _STOP = 1, 2, 3
_HEADER = 6  # kind, T tokens, B sequences, R kept rows, pages listed, pages copied
# rank 0's pool, sent once: ok, pages, page size, pages per sequence, dtype code, and whether the
# steps run in deterministic mode (every rank's shard then reduces as rank 0's does)
_GEOMETRY = 6
_KEY = "selfattn/tp"
ROW_WISE = (
    "out_proj",
    "fc2",
    "down",
)  # the projections split by their inputs  # the store keys of the workers' start and errors


class TensorParallelError(RuntimeError):
    """A tensor-parallel peer failed (raised, died or timed out); the engine cannot step on."""


# -- the model -------------------------------------------------------------------------------------


def _heads(attn: MultiHeadAttention, n: int, where: str) -> None:
    """ValueError unless ``attn``'s heads split into ``n`` whole groups."""
    if isinstance(attn, DiffAttention):
        raise ValueError(
            f"{where}: tensor parallelism does not split differential attention (DiffLlama); "
            "serve it with one process"
        )
    for name, bad in (
        ("attention sinks", attn.sinks is not None),
        ("ALiBi", attn.alibi is not None),
        ("a QK-norm over all heads (qk_norm_scope='all', OLMo-2)", attn.qk_norm_scope == "all"
         and attn.q_norm is not None),
    ):  # fmt: skip
        if bad:
            raise ValueError(
                f"{where}: tensor parallelism does not split {name} yet; serve it with one process"
            )
    if attn.n_kv_heads % n:
        raise ValueError(
            f"{where}: n_kv_heads ({attn.n_kv_heads}) must be divisible by the tensor-parallel "
            f"size ({n}): each rank holds whole kv heads; pick a size among the divisors of "
            f"{attn.n_kv_heads}"
        )


class ReducedLinear(nn.Module):
    """A row-wise parallel projection: this rank's columns of the weight (``part``: an
    ``nn.Linear`` or :class:`~selfattn.nn.QuantizedLinear` without bias) give a partial
    product, one all-reduce sums the ranks' partials, then the bias is added once."""

    def __init__(self, part: nn.Module, bias: torch.Tensor | None, group):
        super().__init__()
        self.part, self.group = part, group
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.part(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _rows(m: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Column-wise parallel: the projection of ``m``'s output rows ``rows`` (its bias's too)."""
    if isinstance(m, QuantizedLinear):
        return m.part(rows=rows)
    w, b = m.weight.detach(), m.bias
    out = nn.Linear(w.shape[1], len(rows), bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w.index_select(0, rows))
        if b is not None:
            out.bias.copy_(b.detach().index_select(0, rows))
    return out.requires_grad_(m.weight.requires_grad)


def _cols(m: nn.Module, r: int, n: int, group) -> ReducedLinear:
    """Row-wise parallel: rank ``r`` of ``n``'s share of ``m``'s input columns."""
    K = m.in_features
    lo, hi = r * K // n, (r + 1) * K // n
    if isinstance(m, QuantizedLinear):
        part = m.part(cols=slice(lo, hi))  # the edges were checked (_splits)
    else:
        w = m.weight.detach()
        part = nn.Linear(hi - lo, w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            part.weight.copy_(w[:, lo:hi])
        part.requires_grad_(m.weight.requires_grad)
    return ReducedLinear(part, m.bias, group)


def _qkv_rows(attn: MultiHeadAttention, r: int, n: int) -> torch.Tensor:
    """Rank ``r`` of ``n``'s rows of the fused ``qkv_proj`` ``[q | k | v]``: its own heads'
    q, k and v."""
    D, Hq, Hkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q, kv = Hq * D, Hkv * D
    idx = [*range(r * q // n, (r + 1) * q // n)]
    idx += range(q + r * kv // n, q + (r + 1) * kv // n)
    idx += range(q + kv + r * kv // n, q + kv + (r + 1) * kv // n)
    return torch.tensor(idx)


def _share(size: int, r: int, n: int) -> torch.Tensor:
    return torch.arange(r * size // n, (r + 1) * size // n)


def tensor_parallel(model: CausalLM, mesh) -> CausalLM:
    """Split ``model`` (in place) across the ranks of the 1-D ``mesh`` (a
    :class:`~torch.distributed.device_mesh.DeviceMesh`; module docstring); returns it.

    Every rank calls it on the same full weights (no weight crosses ranks). Column-wise
    parallel projections become this rank's rows (``nn.Linear`` or, kept quantised, a
    :meth:`QuantizedLinear.part <selfattn.nn.QuantizedLinear.part>`), row-wise parallel ones a
    :class:`ReducedLinear`: plain modules without hooks, so the ranks run the blocks' lean
    decode step (:class:`~selfattn.nn.blocks.RowsStep`) as one process does. Afterwards
    ``model.config`` describes this rank's shard (``n_heads`` / ``n_kv_heads`` per rank), so a
    cache built from it holds this rank's heads. Raises ValueError for what it cannot split
    (kv heads not divisible by the mesh size, sinks, ALiBi, OLMo-2's QK-norm, DiffLlama,
    mixtures of experts, quantised inputs that do not split on block edges) before changing
    anything.
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"tensor_parallel splits selfattn's decoder LMs, got {type(model)}")
    n, r, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    plans = []
    for i, block in enumerate(model.layers):
        attns = [m for m in block.modules() if isinstance(m, MultiHeadAttention)]
        mlps = [m for m in block.modules() if isinstance(m, (MLP, SwiGLU))]
        if len(attns) != 1 or len(mlps) != 1:
            raise ValueError(
                f"layer {i}: tensor parallelism splits one attention and one MLP / SwiGLU per "
                f"block, found {len(attns)} and {len(mlps)} (mixture-of-experts layers are not "
                "split yet); serve this model with one process"
            )
        _heads(attns[0], n, f"layer {i}")
        _splits(block, n, f"layer {i}")
        plans.append((attns[0], mlps[0]))
    for attn, mlp in plans:
        if attn.fused:
            attn.qkv_proj = _rows(attn.qkv_proj, _qkv_rows(attn, r, n))
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                m = getattr(attn, name)
                setattr(attn, name, _rows(m, _share(m.out_features, r, n)))
        attn.out_proj = _cols(attn.out_proj, r, n, group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        ins, out = (("gate", "up"), "down") if isinstance(mlp, SwiGLU) else (("fc1",), "fc2")
        for name in ins:
            m = getattr(mlp, name)
            setattr(mlp, name, _rows(m, _share(m.out_features, r, n)))
        setattr(mlp, out, _cols(getattr(mlp, out), r, n, group))
    c = model.config
    model.config = dataclasses.replace(c, n_heads=c.n_heads // n, n_kv_heads=c.n_kv_heads // n)
    return model


def _splits(block, n: int, where: str) -> None:
    """ValueError unless the block's quantised row-wise parallel projections split into ``n``
    shares of their inputs on group edges."""
    for name, m in block.named_modules():
        if isinstance(m, QuantizedLinear) and name.rsplit(".", 1)[-1] in ROW_WISE:
            K = m.in_features
            for r in range(n):
                try:
                    column_groups(r * K // n, (r + 1) * K // n, m.group)
                except ValueError as e:
                    raise ValueError(
                        f"{where}: {name}'s {K} inputs do not split into {n} shares ({e}); "
                        "serve it with fewer processes"
                    ) from None


# -- the step message ------------------------------------------------------------------------------


def _step_message(kv: PagedKV, x, step, rows) -> torch.Tensor:
    """One int64 tensor: the header, then tokens, kept rows, sequence ids, counts, lengths
    before the step, pages per sequence, the pages, and the (old, new) pages copied on write."""
    plan = step.layers[0].plan
    ids, lens, npages, pages = [], [], [], []
    for s, _, n in plan.before:
        mine = kv.pages(s)
        ids.append(s)
        lens.append(n)
        npages.append(len(mine))
        pages += mine
    copies = [p for pair in plan.copies for p in pair]
    T, R, B = x.numel(), rows.numel(), len(ids)
    head = [_STEP, T, B, R, len(pages), len(plan.copies)]
    tail = torch.tensor(ids + list(plan.counts) + lens + npages + pages + copies, dtype=torch.long)
    return torch.cat([torch.tensor(head), x.view(-1).cpu(), rows.cpu(), tail])


def _apply_step(kv: PagedKV, head: list[int], payload: torch.Tensor):
    """The worker's side of :func:`_step_message`: the step rank 0 planned, applied to the
    worker's cache (:meth:`PagedKV.apply_plan`); returns ``(x, step, rows)``."""
    _, T, B, R, n_pages, n_copies = head
    x, rows = payload[:T].view(1, T), payload[T : T + R]
    rest = payload[T + R :].tolist()
    ids, counts, lens, npages = (rest[i * B : (i + 1) * B] for i in range(4))
    pages, copies = rest[4 * B : 4 * B + n_pages], rest[4 * B + n_pages :]
    ends = list(itertools.accumulate(npages, initial=0))
    page_lists = [pages[a:b] for a, b in itertools.pairwise(ends)]
    pairs = [(copies[2 * i], copies[2 * i + 1]) for i in range(n_copies)]
    return x, kv.apply_plan(ids, counts, lens, page_lists, pairs), rows


# -- rank 0 ----------------------------------------------------------------------------------------


class TensorParallelEngine(Engine):
    """An :class:`~selfattn.serving.Engine` on rank 0 of a tensor-parallel group (built by
    :func:`tensor_parallel_engine`): each step runs on every rank. ``world_size`` ranks;
    :meth:`close` ends the workers and the process group."""

    compression_refused = (
        "a tensor-parallel engine's ranks mirror rank 0's pages step by step and do not move "
        "tokens between them; drop kv_compression"
    )

    def __init__(self, model, *, timeout_s, workers=(), store=None, owns_group=True, **kw):
        self.world_size = dist.get_world_size()
        self._workers, self._store, self._owns_group = list(workers), store, owns_group
        self._timeout_s = timeout_s
        self._comm = threading.Lock()  # one collective sequence at a time (steps, heartbeats)
        self._broken: TensorParallelError | None = None
        self._closed = False
        self._last_message = time.monotonic()
        device = _device(model)
        try:
            # Speculative steps need nothing more: each step's message carries every sequence's
            # length and pages, so the ranks follow rank 0's rollback of rejected drafts.
            super().__init__(model, **kw)
            if isinstance(self.kv, KIVIPagedKV):
                raise ValueError(
                    "a tensor-parallel engine shards float or int8/fp8 pages; kv_dtype "
                    f"{self.config.kv_dtype!r} (KIVI pages) runs on one device: drop it or "
                    "world_size"
                )
        except BaseException:
            _broadcast(torch.zeros(_GEOMETRY, dtype=torch.long, device=device))  # workers stop
            raise
        kv = self.kv
        geometry = [1, kv.num_pages, kv.page_size, kv.max_pages_per_seq, _dtype_code(kv),
                    int(self.config.deterministic)]  # fmt: skip
        _broadcast(torch.tensor(geometry, device=device))
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True,
                                           name="selfattn-tp-heartbeat")  # fmt: skip
        self._heartbeat.start()

    def _forward(self, x, step, rows):
        with self._comm:
            if self._broken is not None:
                raise TensorParallelError(str(self._broken)) from self._broken
            if self._closed:
                raise TensorParallelError("the tensor-parallel engine is closed")
            self._check_workers()
            msg = _step_message(self.kv, x, step, rows).to(x.device)
            try:
                _broadcast(msg[:_HEADER])
                _broadcast(msg[_HEADER:])
                logits = super()._forward(x, step, rows)
            except Exception as e:
                raise self._break(e) from e
            self._last_message = time.monotonic()
            return logits

    def _beat(self) -> None:
        """While idle, a header every ``timeout_s / HEARTBEATS_PER_TIMEOUT`` seconds keeps the
        waiting workers' broadcast under its timeout."""
        every = self._timeout_s / HEARTBEATS_PER_TIMEOUT
        while not self._stop.wait(every / 2):
            with self._comm:
                if self._closed or self._broken is not None:
                    return
                if time.monotonic() - self._last_message < every:
                    continue
                try:
                    _broadcast(_header(_IDLE, self.kv.k_store.device))
                except Exception as e:
                    self._break(e)
                    return
                self._last_message = time.monotonic()

    def _check_workers(self) -> None:
        dead = [(r, p.poll()) for r, p in enumerate(self._workers, 1) if p.poll() is not None]
        if dead:
            r, code = dead[0]
            raise self._break(RuntimeError(f"worker rank {r} is gone (exit code {code})"))

    def _break(self, cause: BaseException) -> TensorParallelError:
        """Record the failure (with the workers' own errors), end the workers; the error."""
        if self._broken is None:
            time.sleep(_POLL_S * 4)  # a dying worker writes its error before it exits
            told = _worker_errors(self._store, self.world_size)
            for r, p in enumerate(self._workers, 1):
                if r not in told and p.poll() is not None:
                    told[r] = f"exited with code {p.poll()}"
            detail = "".join(f"\n  rank {r}: {msg}" for r, msg in told.items()) or (
                "\n  (no worker reported an error: see the workers' logs)"
            )
            self._broken = TensorParallelError(
                f"a tensor-parallel step across {self.world_size} ranks failed: "
                f"{type(cause).__name__}: {cause}{detail}\nthe engine cannot run more steps; "
                "close() it and start a new one"
            )
            _end(self._workers)
        return self._broken

    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after ``timeout_s``) and leave the
        process group; idempotent. Rank 0's engine state stays readable."""
        if self._closed:
            return
        super().close()
        self._stop.set()
        with self._comm:
            self._closed = True
            if self._broken is None:
                try:
                    _broadcast(_header(_STOP, self.kv.k_store.device))
                except Exception as e:  # a worker is gone: end the rest
                    self._break(e)
            deadline = time.monotonic() + self._timeout_s
            for p in self._workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
            _end(self._workers)
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()

    def __del__(self):
        if getattr(self, "_workers", None) and not getattr(self, "_closed", True):
            _end(self._workers)


def _broadcast(t: torch.Tensor) -> None:
    dist.broadcast(t, src=0)


def _header(kind: int, device) -> torch.Tensor:
    return torch.tensor([kind] + [0] * (_HEADER - 1), device=device)


_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.float8_e4m3fn)  # fmt: skip


def _dtype_code(kv: PagedKV) -> int:
    return _KV_DTYPES.index(kv.k_store.dtype)


def _end(workers) -> None:
    """Kill the workers still running and reap them."""
    for p in workers:
        if p.poll() is None:
            p.kill()
    for p in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=_POLL_S * 20)


def _worker_errors(store, n: int) -> dict[int, str]:
    if store is None:
        return {}
    out = {}
    for r in range(1, n):
        key = f"{_KEY}/error/{r}"
        if store.check([key]):
            out[r] = store.get(key).decode(errors="replace").strip()
    return out


# -- the workers -----------------------------------------------------------------------------------


def _serve_steps(model: CausalLM) -> None:
    """Rank ``r > 0``: build the mirror pages rank 0 describes, then run every step it sends
    until it stops (or stopped: a geometry with status 0)."""
    device = _device(model)
    geometry = torch.zeros(_GEOMETRY, dtype=torch.long, device=device)
    _broadcast(geometry)
    ok, num_pages, page_size, max_pages, code, exact = geometry.tolist()
    if not ok:
        return
    c = model.config
    kv = PagedKV(
        c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim, c.value_dim,
        max_seqs=1, max_pages_per_seq=max_pages, dtype=_KV_DTYPES[code], device=device,
    )  # fmt: skip
    head = torch.zeros(_HEADER, dtype=torch.long, device=device)
    while True:
        _broadcast(head)
        h = head.tolist()
        if h[0] == _STOP:
            return
        if h[0] != _STEP:
            continue
        _, T, B, R, n_pages, n_copies = h
        payload = torch.empty(T + R + 4 * B + n_pages + 2 * n_copies, dtype=torch.long,
                              device=device)  # fmt: skip
        _broadcast(payload)
        with torch.no_grad(), deterministic(bool(exact)):  # the plan too: it reads the mode
            x, step, rows = _apply_step(kv, h, payload)
            model(x, cache=step, logits_to_keep=rows)


def _device(model: CausalLM) -> torch.device:
    """Where the model's weights live (a quantised LM head has no ``weight``)."""
    return next(itertools.chain(model.parameters(), model.buffers())).device


def _load(model_dir, load, device) -> CausalLM:
    """The model of ``model_dir`` with ``load = (dtype, quantize, quantize_group)``, as
    :func:`selfattn.models.from_pretrained` reads them."""
    from selfattn.models import from_pretrained

    dtype, quantize, group = load
    model = from_pretrained(model_dir, dtype, device=device, quantize=quantize,
                            quantize_group=group).eval()  # fmt: skip
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"{str(model_dir)!r} holds a {type(model).__name__}; tensor-parallel serving runs "
            "selfattn's decoder LMs (GPT-2, Llama, Mistral, Qwen2, Gemma-2)"
        )
    return model


def _split(model: CausalLM, device_type: str) -> CausalLM:
    from torch.distributed.device_mesh import init_device_mesh

    return tensor_parallel(model, init_device_mesh(device_type, (dist.get_world_size(),)))


def _worker_main(rank, n, port, model_dir, load, device_type, timeout_s, start_s, threads):
    """A worker process: meet rank 0 on its store, load, join the group, serve steps."""
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    start = datetime.timedelta(seconds=max(timeout_s, start_s))
    store = dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=start)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    code = 0
    try:
        if device_type == "cuda":
            torch.cuda.set_device(device)  # NCCL runs on the current device
        model = _load(model_dir, load, device)
        store.set(f"{_KEY}/loaded/{rank}", "1")
        dist.init_process_group(_backend(device_type), store=store, rank=rank, world_size=n,
                                timeout=timeout)  # fmt: skip
        _serve_steps(_split(model, device_type))
    except BaseException as e:
        code = 1
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        with contextlib.suppress(Exception):  # rank 0 (the store's host) may be gone
            store.set(f"{_KEY}/error/{rank}", text)
        traceback.print_exc()
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips the interpreter's teardown: seconds of finalisers, nothing to save


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


# -- the entry point -------------------------------------------------------------------------------


def tensor_parallel_engine(
    model_dir,
    n: int,
    *,
    dtype="auto",
    quantize: str | None = None,
    quantize_group: int | None = None,
    device: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    **engine_kwargs,
) -> Engine:
    """An engine over the model in ``model_dir`` split across ``n`` processes (module
    docstring); ``engine_kwargs`` go to :class:`~selfattn.serving.Engine` (``tokenizer``,
    ``config``: an :class:`~selfattn.serving.EngineConfig` whose ``kv_cache_bytes`` is per
    rank, or its fields as keywords). The workers build their pages from rank 0's (the pool's
    geometry is broadcast once), so the config is read in one place. ``n == 1`` is a plain
    Engine.

    ``dtype``, ``quantize``, ``quantize_group``: as :func:`selfattn.models.from_pretrained`
    (a quantised model's projections split on their blocks, kept quantised). ``device``: None /
    ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; rank ``r`` on GPU ``LOCAL_RANK``, or ``r`` when
    spawned here). ``timeout_s`` bounds every collective, ``start_timeout_s`` the workers'
    start (loading the model, meeting rank 0). Under torchrun (``WORLD_SIZE``
    in the environment, which must equal ``n``) it joins that group; on ranks other than 0 it
    serves steps and then raises ``SystemExit(0)`` instead of returning.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the tensor-parallel size n must be a positive int, got {n!r}")
    device_type = "cpu" if device is None else torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensor parallelism runs on 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}"
        )
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    if not (dtype is None or isinstance(dtype, str)):
        dtype = str(dtype).removeprefix("torch.")  # the workers read it from their arguments
    load = (dtype, quantize, quantize_group)
    if n == 1:
        return Engine(_load(model_dir, load, device), **engine_kwargs)
    if "WORLD_SIZE" in os.environ:
        return _join_torchrun(model_dir, n, load, device_type, timeout_s, engine_kwargs)
    return _spawn(model_dir, n, load, device_type, (timeout_s, start_timeout_s), engine_kwargs)


def _spawn(model_dir, n, load, device_type, timeouts, engine_kwargs) -> Engine:
    timeout_s, start_timeout_s = timeouts
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group; spawning tensor-parallel "
            "workers needs a fresh process (or launch every rank with torchrun)"
        )
    if device_type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor parallelism over {n} GPUs, but this machine has "
            f"{torch.cuda.device_count()}; lower n or launch across machines with torchrun"
        )
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    model = _load(model_dir, load, device)  # fails fast on a bad folder, before any worker
    _check_split(model, n)
    timeout = datetime.timedelta(seconds=timeout_s)
    start = datetime.timedelta(seconds=max(timeout_s, start_timeout_s))
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=start,
                          wait_for_workers=False)  # fmt: skip
    workers = [_start_worker(r, n, store.port, model_dir, load, device_type, timeouts)
               for r in range(1, n)]  # fmt: skip
    try:
        _wait_loaded(store, workers, n, start_timeout_s)
        dist.init_process_group(_backend(device_type), store=store, rank=0, world_size=n,
                                timeout=timeout)  # fmt: skip
        _split(model, device_type)
        return TensorParallelEngine(model, timeout_s=timeout_s, workers=workers, store=store,
                                    **engine_kwargs)  # fmt: skip
    except BaseException:
        _end(workers)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def _start_worker(rank, n, port, model_dir, load, device_type, timeouts) -> subprocess.Popen:
    """A fresh Python running :func:`_worker_main` (not multiprocessing's spawn: that re-imports
    the caller's main module, which a script without a ``__main__`` guard cannot survive)."""
    args = [rank, n, port, str(model_dir), load, device_type, *timeouts, torch.get_num_threads()]
    code = f"from selfattn.serving.parallel import _worker_main; _worker_main(*{args!r})"
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # this selfattn, wherever it is installed
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def _check_split(model: CausalLM, n: int) -> None:
    """The checks of :func:`tensor_parallel` on rank 0 alone, before workers start."""
    for i, block in enumerate(model.layers):
        _splits(block, n, f"layer {i}")
        for m in block.modules():
            if isinstance(m, MultiHeadAttention):
                _heads(m, n, f"layer {i}")


def _wait_loaded(store, workers, n: int, timeout_s: float) -> None:
    """Until every worker has loaded its model; TensorParallelError when one fails, dies or
    takes longer than ``timeout_s``."""
    end = time.monotonic() + timeout_s
    keys = [f"{_KEY}/loaded/{r}" for r in range(1, n)]
    while not store.check(keys):
        errors = _worker_errors(store, n)
        dead = [(r, p.poll()) for r, p in enumerate(workers, 1) if p.poll() is not None]
        if errors or dead or time.monotonic() > end:
            if dead and not errors:
                time.sleep(_POLL_S * 4)
                errors = _worker_errors(store, n)
            why = "".join(f"\n  rank {r}: {m}" for r, m in errors.items())
            why += "".join(f"\n  rank {r} exited with code {c}" for r, c in dead if r not in errors)
            raise TensorParallelError(
                f"tensor-parallel workers failed to start:{why or ' none ready after '}"
                + ("" if why else f"{timeout_s} s (start_timeout_s)")
            )
        time.sleep(_POLL_S)


def _join_torchrun(model_dir, n, load, device_type, timeout_s, engine_kwargs) -> Engine:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    if world != n:
        raise ValueError(
            f"--tensor-parallel {n} but torchrun started WORLD_SIZE={world} processes; make them "
            "equal (--nnodes × --nproc-per-node)"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(_backend(device_type),
                                timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    model = _split(_load(model_dir, load, device), device_type)
    if rank == 0:
        return TensorParallelEngine(model, timeout_s=timeout_s, owns_group=owns, **engine_kwargs)
    try:
        _serve_steps(model)
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()
    raise SystemExit(0)
