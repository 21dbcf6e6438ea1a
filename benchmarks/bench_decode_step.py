"""A compiled decode step for any model of MultiHeadAttention layers: DecodeStep vs eager.

The model is a small decoder built only from public pieces (embedding, ``nn.MultiHeadAttention``
layers with RoPE, GQA and a ``layer_idx``, feed-forward blocks, a vocabulary head); the cache a
``StaticCache``, one per batch size, reset by every call (so that a CUDA graph is recorded once,
not once per call). Cases, timed round-robin in one process (one greedy decode of ``--new``
tokens after an eager prefill per call; on CUDA each call ends with a synchronize):

  eager        model(token, cache=cache) per step: each layer reads the cache's length
  DecodeStep   attnlab.models.DecodeStep(model): one compiled graph for every step, positions
               and slots found on the device (on CUDA: replayed as a CUDA graph)

Both must produce the same tokens (checked). Figures: ms per step and the ratio.

Usage:
  python benchmarks/bench_decode_step.py [--device cpu|cuda] [--threads N] [--batch 1 4]
      [--layers 4] [--d-model 256] [--prompt 64] [--new 48] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnlab.cache import StaticCache  # noqa: E402
from attnlab.models import DecodeStep  # noqa: E402
from attnlab.nn import MultiHeadAttention  # noqa: E402
from common import device_sync, header, ratio_line, round_robin  # noqa: E402


class Decoder(torch.nn.Module):
    """(B, L) ids -> (B, L, V) logits; pre-norm attention and feed-forward blocks."""

    def __init__(self, vocab: int, d_model: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.attn = torch.nn.ModuleList(
            MultiHeadAttention(d_model, 8, num_kv_heads=2, is_causal=True, rope=True, layer_idx=i)
            for i in range(layers)
        )
        self.ff = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(d_model),
                torch.nn.Linear(d_model, 4 * d_model),
                torch.nn.GELU(),
                torch.nn.Linear(4 * d_model, d_model),
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, ids, cache=None):
        x = self.embed(ids)
        for attn, ff in zip(self.attn, self.ff, strict=True):
            x = x + attn(x, cache=cache)
            x = x + ff(x)
        return self.head(x)


@torch.no_grad()
def greedy(model, step, ids, new, cache):
    """Prefill ``ids`` eagerly, then ``new`` greedy tokens through ``step``, in ``cache``.

    The cache is reset here, not made: every call of a batch size reuses one cache, whose
    storage keeps its address (a CUDA graph replays over it; a new cache per call would have
    the graph recorded again in every timed call).
    """
    cache.reset()
    token = model(ids, cache=cache)[:, -1:].argmax(-1)
    out = [token]
    for _ in range(new):
        token = step(token, cache)[:, -1:].argmax(-1)
        out.append(token)
    return torch.cat(out, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 8000
    model = Decoder(vocab, args.d_model, args.layers).to(args.device).eval()
    header(
        f"greedy decode step, {args.layers} layers of d {args.d_model} (8 query / 2 kv heads), "
        f"{args.prompt}-token prompt, {args.new} new tokens, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    for B in args.batch:
        ids = torch.randint(0, vocab, (B, args.prompt), device=args.device)
        eager = lambda tok, cache: model(tok, cache=cache)  # noqa: E731
        step = DecodeStep(model)  # one per batch size: the graph is bound to its geometry
        cache = StaticCache(args.prompt + args.new + 1)  # one per batch size too (see greedy)
        want = greedy(model, eager, ids, args.new, cache)
        got = greedy(model, step, ids, args.new, cache)
        same = "same tokens" if torch.equal(want, got) else "TOKENS DIFFER"
        stats = round_robin(
            {
                "DecodeStep": lambda: greedy(model, step, ids, args.new, cache),
                "eager": lambda: greedy(model, eager, ids, args.new, cache),
            },
            rounds=args.rounds,
            warmup=1,
            sync=device_sync(args.device),
        )
        print(ratio_line(f"B={B} DecodeStep vs eager ({same})", stats, "DecodeStep", "eager"))
        per_step = stats["DecodeStep"]["median"] / args.new * 1e3
        print(f"    DecodeStep {per_step:.2f} ms per step (prefill included in the totals)")


if __name__ == "__main__":
    main()
