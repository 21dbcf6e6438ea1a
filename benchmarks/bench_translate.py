#!/usr/bin/env python3
"""Where a translator's time goes: one training step and one decoding pass per model, on the
Bible corpus, with 1 and 2 threads, timed round-robin (PERF.md: the machine has slow and fast
phases, so compare cases within one run and read ratios).

Usage::

    python benchmarks/bench_translate.py                 # all models, 1 and 2 threads
    python benchmarks/bench_translate.py --models transformer-multihead,rnn-bahdanau --profile
    python benchmarks/bench_translate.py --models transformer-multihead --precision bf16 \
        --without-kernel     # bf16 training with attnlab's blocked kernel, and without it

Prints target tokens per second for training (forward + backward + AdamW) and for greedy
decoding with and without attention weights, and with ``--profile`` the top operators of one
training step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import attnlab.kernels  # noqa: E402
from attnlab.data import load_bible  # noqa: E402
from attnlab.translate import gpu  # noqa: E402
from attnlab.translate.batching import (  # noqa: E402
    collate,
    encode_pairs,
    epoch_batches,
    source_tensor,
)
from attnlab.translate.decoding import greedy  # noqa: E402
from attnlab.translate.models import build_model, count_parameters, model_config  # noqa: E402
from attnlab.translate.tokenizer import Tokenizer  # noqa: E402
from attnlab.translate.trainer import token_loss  # noqa: E402

MODELS = (
    "transformer-multihead",
    "transformer-gqa",
    "rnn-bahdanau",
    "rnn-luong-general",
    "rnn-multihead",
    "rnn-none",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--without-kernel",
        action="store_true",
        help="also train each model with attnlab's blocked CPU kernel turned off (the path "
        "attention took before it), in the same rounds: before/after in one run",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="training under bf16 autocast as `attnlab train --precision bf16` (the attention "
        "then trains in bf16: the blocked kernel where the dispatch measured it faster)",
    )
    args = parser.parse_args()

    pairs = load_bible("train")[:4000]
    tok = Tokenizer.train([p.source for p in pairs] + [p.target for p in pairs], "bpe", 8000)
    data, _ = encode_pairs(tok, pairs, 128)
    batch = collate(data, epoch_batches(data, seed=0, epoch=0, max_tokens=args.max_tokens)[0])
    test = load_bible("test")[:64]
    src, lengths = source_tensor(tok.encode_batch([p.source for p in test]))
    print(
        f"train batch {tuple(batch.src.shape)} -> {tuple(batch.tgt_out.shape)}, "
        f"{batch.num_tokens} target tokens, {args.precision}; decode {len(test)} verses greedy"
    )

    models = {}
    for name in args.models.split(","):
        kind, attention = name.split("-", 1)
        torch.manual_seed(0)
        m = build_model(model_config(kind, attention, args.size), tok.vocab_size)
        models[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))

    def train_step(m, opt, kernel=True):
        if not kernel:  # the dispatch then takes the path it took before the kernel existed
            with mock.patch.object(attnlab.kernels, "supports", lambda *a: "turned off"):
                return train_step(m, opt)
        m.train()
        with gpu.autocast("cpu", args.precision):
            loss = token_loss(m(batch.src, batch.src_lengths, batch.tgt_in), batch.tgt_out)
        (loss / batch.num_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def decode(m, weights):
        m.eval()
        hyps = greedy(m, src, lengths, return_attention=weights)
        return sum(len(h.tokens) + 1 for h in hyps)

    results: dict[tuple, list[float]] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for m, opt in models.values():  # warm up
            train_step(m, opt)
        for _ in range(args.rounds):
            for name, (m, opt) in models.items():
                t = time.perf_counter()
                train_step(m, opt)
                results.setdefault((name, threads, "train"), []).append(
                    batch.num_tokens / (time.perf_counter() - t)
                )
                if args.without_kernel:
                    t = time.perf_counter()
                    train_step(m, opt, kernel=False)
                    results.setdefault((name, threads, "train, no kernel"), []).append(
                        batch.num_tokens / (time.perf_counter() - t)
                    )
                for weights in (False, True):
                    t = time.perf_counter()
                    n = decode(m, weights)
                    key = (name, threads, "decode+weights" if weights else "decode")
                    results.setdefault(key, []).append(n / (time.perf_counter() - t))
    print(
        f"{'model':24} {'params':>9} {'threads':>7} {'what':>17} {'median tok/s':>13} {'best':>9}"
    )
    for (name, threads, what), v in results.items():
        params = count_parameters(models[name][0])
        print(
            f"{name:24} {params:9,} {threads:7} {what:>17} {statistics.median(v):13,.0f} "
            f"{max(v):9,.0f}"
        )
    if args.profile:
        torch.set_num_threads(1)
        for name, (m, opt) in models.items():
            with torch.profiler.profile() as prof:
                train_step(m, opt)
            print(f"\n== {name}: one training step, 1 thread ==")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
