"""What the Engine holds per request while it prefills a prompt to be compressed, and the time.

One request of ``--tokens`` prompt tokens (random ids) on the bundled SmolLM2, compressed by
``--policy`` after its prefill in ``--chunk``-token chunks, one thread. Prints the bytes of
the sequence's recorded prefill state (the policy's observation: recorded rows or streamed
statistics) at the moment of compression, the prefill + compression wall and CPU time (best
of ``--repeat``; one thread, so the CPU time is the work's, steadier than the wall time on a
shared machine) and the process's peak RSS growth over the runs::

    PYTHONPATH=src python benchmarks/_prefill_statistics.py --policy observed_attention:0.5
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from selfattn.models import bundled, from_pretrained
from selfattn.serving import Engine, SamplingParams
from selfattn.serving.kv_compression import PromptCompression


def held_bytes(record) -> int:
    """Bytes of the tensors in a sequence's per-layer prefill record (tensors or objects)."""
    if record is None:
        return 0
    total = 0
    for item in record:
        tensors = [item] if isinstance(item, torch.Tensor) else vars(item).values()
        total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="observed_attention:0.5")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = from_pretrained(bundled.chat_model_path())
    engine = Engine(model, max_batch_tokens=args.chunk, prefix_caching=False)
    seen = []
    real = PromptCompression.compress

    def spy(self, seq):
        record = getattr(seq, "observed", getattr(seq, "window", None))
        seen.append(held_bytes(record))
        return real(self, seq)

    PromptCompression.compress = spy
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, kv_compression=args.policy)
    engine.generate([torch.randint(0, vocab, (64,), generator=g).tolist()], params)  # warm up
    base = rss_mib()
    times, cpu = [], []
    for _ in range(args.repeat):
        prompt = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate([prompt], params)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c = model.config
    print(f"model {type(model).__name__} L={c.n_layers} d_model={c.d_model} dtype "
          f"{next(model.parameters()).dtype}; {args.tokens} tokens in {args.chunk}-token chunks, "
          f"{args.policy}, 1 thread")  # fmt: skip
    print(f"held per request at compression: {seen[-1] / 2**20:.2f} MiB")
    print(f"prefill + compression: wall best {min(times):.2f} s of {[round(t, 2) for t in times]}, "
          f"CPU best {min(cpu):.2f} s of {[round(t, 2) for t in cpu]}")  # fmt: skip
    print(f"peak RSS over the runs: {peak - base:+.1f} MiB above {base:.0f} MiB")
    assert engine.metrics.kv_compressed_prompts == args.repeat + 1


if __name__ == "__main__":
    main()
