"""The translator's Transformer beam search: compiled decoder step vs eager, in one run.

The model is ``TransformerSeq2Seq`` of a size from ``attnlab.translate.settings`` (random
weights: every hypothesis runs to its length limit, ``1.5 S + 10`` tokens, which is the most
steps a batch can take). Cases, timed round-robin in one process, each one beam search over the
same batches of sources of different lengths (as ``attnlab translate`` sorts and cuts them):

  eager      a DynamicCache; each step reads the cache's length, grows it, runs ~40 small ops
             per layer from Python
  compiled   ``beam_search(..., compile=True)``: the first token eager, every later step one
             graph compiled once with symbolic sizes (batches of other lengths reuse it) over a
             StaticCache, reset and reused by the next batch of the same length (the same
             addresses); on CUDA replayed as a CUDA graph (recorded once per batch geometry)

Both must give the same hypotheses (checked). The compilation is paid once, in the warm-up,
and reported apart: on CPU it is tens of seconds, which decoding a test set pays back only if
the compiled step is faster. Figures: sentences/s of each, the ratio, the compile time.

Usage:
  python benchmarks/bench_beam.py [--device cpu|cuda] [--threads N] [--size small]
      [--sentences 32] [--lengths 12 24 40] [--beam 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnlab.translate.decoding import beam_search  # noqa: E402
from attnlab.translate.models import build_model, model_config  # noqa: E402
from common import device_sync, header, ratio_line, round_robin  # noqa: E402


def batches(lengths, sentences, vocab, device, seed=0):
    """One (src, lengths) batch per source length: lengths in [n/2, n], padded to n."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        lens = torch.randint(n // 2, n + 1, (sentences,), generator=g)
        lens[0] = n
        src = torch.randint(4, vocab, (sentences, n), generator=g)
        src[torch.arange(n)[None] >= lens[:, None]] = 0  # PAD
        out.append((src.to(device), lens.to(device)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--sentences", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[12, 24, 40])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(model_config("transformer", None, args.size), args.vocab)
    model = model.to(args.device).eval()
    data = batches(args.lengths, args.sentences, args.vocab, args.device)

    def run(compile):
        return [
            beam_search(model, src, lens, beam_size=args.beam, compile=compile)
            for src, lens in data
        ]

    header(
        f"beam search (beam {args.beam}), Transformer {args.size}, {len(data)} batches of "
        f"{args.sentences} sentences of {args.lengths} tokens, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    start = time.perf_counter()
    compiled = run(True)  # compiles here (hypotheses are read to the host: nothing left queued)
    first = time.perf_counter() - start
    eager = run(False)
    same = all(
        [h.tokens for h in a] == [h.tokens for h in b] for a, b in zip(eager, compiled, strict=True)
    )
    stats = round_robin({"compiled": lambda: run(True), "eager": lambda: run(False)},
                        rounds=args.rounds, warmup=0, sync=device_sync(args.device))  # fmt: skip
    label = f"compiled vs eager ({'same hypotheses' if same else 'HYPOTHESES DIFFER'})"
    print(ratio_line(label, stats, "compiled", "eager"))
    n = args.sentences * len(data)
    for case in ("compiled", "eager"):
        print(f"    {case:9s} {n / stats[case]['median']:.1f} sentences/s")
    print(f"    first compiled run (compilation included): {first:.1f} s")


if __name__ == "__main__":
    main()
