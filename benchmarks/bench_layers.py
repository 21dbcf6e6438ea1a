"""attnlab's layers and caches against their peers, in one run; prints times and ratios.

1. Prefill: ``MultiHeadAttention`` vs ``torch.nn.MultiheadAttention``, forward (inference) and
   forward+backward (training), without and with attention weights.
2. Weights on demand: ``return_weights`` time vs without (target <= 1.5x), and peak memory vs
   ``nn.MultiheadAttention(need_weights=True)`` at L = 1024 and 4096.
3. Decode: latency of one generation step of a tiny random Llama, attnlab's model with each
   cache kind vs Hugging Face's ``LlamaForCausalLM`` with its DynamicCache and StaticCache.

Allocator: materialised weights are dominated by page faults on fresh memory; see
``common.py`` for ``THP_MEM_ALLOC_ENABLE=1`` and run the script a second time with it.

Usage: ``python benchmarks/bench_layers.py [--quick] [--only prefill|weights|decode]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnlab.nn import MultiHeadAttention  # noqa: E402
from common import header, peak_rss_mib_in_child, ratio_line, report_peak, round_robin  # noqa: E402

D, H = 512, 8


def layers():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(D, H, batch_first=True)
    return MultiHeadAttention.from_torch(ref), ref


def bench_prefill(rounds: int) -> None:
    header("prefill: attnlab MultiHeadAttention vs torch nn.MultiheadAttention (D=512, H=8)")
    ours, ref = layers()
    for B, L in ((8, 256), (4, 1024)):
        x = torch.randn(B, L, D)
        ours.eval(), ref.eval()
        with torch.no_grad():
            stats = round_robin(
                {
                    "ours": lambda: ours(x),
                    "torch": lambda: ref(x, x, x, need_weights=False),
                    "ours-w": lambda: ours(x, return_weights=True, average_weights=True),
                    "torch-w": lambda: ref(x, x, x, need_weights=True),
                },
                rounds=rounds,
            )
        print(ratio_line(f"fwd eval            B={B} L={L}", stats, "ours", "torch"))
        print(ratio_line(f"fwd eval + weights  B={B} L={L}", stats, "ours-w", "torch-w"))
        ours.train(), ref.train()
        xg = x.clone().requires_grad_()

        def step(fn):
            def run():
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                out.sum().backward()

            return run

        stats = round_robin(
            {
                "ours": step(lambda: ours(xg)),
                "torch": step(lambda: ref(xg, xg, xg, need_weights=False)),
                "ours-w": step(lambda: ours(xg, return_weights=True, average_weights=True)),
                "torch-w": step(lambda: ref(xg, xg, xg, need_weights=True)),
            },
            rounds=max(3, rounds // 2),
        )
        print(ratio_line(f"fwd+bwd train       B={B} L={L}", stats, "ours", "torch"))
        print(ratio_line(f"fwd+bwd + weights   B={B} L={L}", stats, "ours-w", "torch-w"))


WEIGHT_SHAPES = {"1024": (4, 1024), "4096": (1, 4096)}


def weights_case(name: str):
    which, size = name.split("-")
    B, L = WEIGHT_SHAPES[size]
    ours, ref = layers()
    ours.eval(), ref.eval()

    def setup():
        return torch.randn(B, L, D)

    def warm():  # (common.report_peak: a first call's one-off costs, at a tiny shape)
        return torch.randn(1, 8, D)

    def run(x):
        with torch.no_grad():
            if which == "ours":
                return ours(x, return_weights=True, average_weights=True)
            if which == "ourshead":
                return ours(x, return_weights=True)
            if which == "oursnone":
                return ours(x)
            return ref(x, x, x, need_weights=True)

    return run, setup, warm


def bench_weights(rounds: int) -> None:
    header("weights on demand: time vs no weights (target <= 1.5x); memory vs torch")
    here = str(Path(__file__).resolve())
    ours, ref = layers()
    ours.eval(), ref.eval()
    for size, (B, L) in WEIGHT_SHAPES.items():
        x = torch.randn(B, L, D)
        r = rounds if L <= 1024 else max(3, rounds // 3)
        with torch.no_grad():
            stats = round_robin(
                {
                    "none": lambda: ours(x),
                    "average": lambda: ours(x, return_weights=True, average_weights=True),
                    "per-head": lambda: ours(x, return_weights=True),
                    "torch": lambda: ref(x, x, x, need_weights=True),
                },
                rounds=r,
            )
        print(ratio_line(f"averaged weights vs none  B={B} L={L}", stats, "average", "none"))
        print(ratio_line(f"per-head weights vs none  B={B} L={L}", stats, "per-head", "none"))
        print(ratio_line(f"averaged vs torch need_weights B={B} L={L}", stats, "average", "torch"))
        mem = {
            w: peak_rss_mib_in_child(here, f"{w}-{size}")
            for w in ("oursnone", "ours", "ourshead", "torch")
        }
        print(
            f"peak memory B={B} L={L}: attnlab no weights {mem['oursnone']:.0f} MiB, averaged "
            f"{mem['ours']:.0f} MiB, per head {mem['ourshead']:.0f} MiB; torch need_weights "
            f"{mem['torch']:.0f} MiB (x{mem['torch'] / max(mem['ours'], 1):.1f} attnlab averaged)"
        )


def bench_decode(rounds: int) -> None:
    import transformers
    from transformers import DynamicCache as HFDynamic
    from transformers import StaticCache as HFStatic

    from attnlab.models import LlamaModel

    header("decode step latency, tiny random Llama (4 layers, d 256, GQA 8/2), prompt 128")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.set_attn_implementation("sdpa")
    ours = LlamaModel.from_hf(hf)
    prompt = torch.randint(0, 1024, (1, 128))
    steps, max_len = 32, 128 + 32 + 1
    nxt = torch.tensor([[5]])

    def ours_steps(kind, n=steps):
        def run():
            cache = ours.make_cache(kind, max_len)
            ours(prompt, cache=cache)
            for t in range(n):
                ours(nxt, cache=cache, position_ids=torch.tensor([128 + t]))

        return run

    def hf_steps(kind, n=steps):
        def run():
            cache = HFDynamic(config=cfg) if kind == "dynamic" else HFStatic(cfg, max_len)
            hf(input_ids=prompt, past_key_values=cache, use_cache=True)
            for t in range(n):
                pos = torch.tensor([128 + t])
                hf(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=pos)

        return run

    # each case's own prefill, into its own kind of cache (a static one's prefill attends over
    # every slot and builds the cache: a dynamic prefill subtracted from a static run put
    # the difference into its steps)
    cases = {}
    for kind in ("dynamic", "static"):
        cases[f"ours-{kind}"], cases[f"hf-{kind}"] = ours_steps(kind), hf_steps(kind)
        cases[f"ours-{kind}-prefill"] = ours_steps(kind, 0)
        cases[f"hf-{kind}-prefill"] = hf_steps(kind, 0)
    with torch.no_grad():
        stats = round_robin(cases, rounds=rounds)
    for name in list(stats):  # per decode step: (prefill + steps - prefill) / steps
        if not name.endswith("prefill"):
            base = stats[name + "-prefill"]
            stats[name] = {k: (v - base[k]) / steps for k, v in stats[name].items()}
    print(
        ratio_line(
            "per step: attnlab dynamic vs HF DynamicCache", stats, "ours-dynamic", "hf-dynamic"
        )
    )
    print(
        ratio_line("per step: attnlab static vs HF StaticCache", stats, "ours-static", "hf-static")
    )
    swcfg = transformers.MistralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=64,
    )
    torch.manual_seed(0)
    mistral = LlamaModel.from_hf(transformers.MistralForCausalLM(swcfg).eval())

    def sliding():
        cache = mistral.make_cache("sliding")
        mistral(prompt, cache=cache)
        for t in range(steps):
            mistral(nxt, cache=cache, position_ids=torch.tensor([128 + t]))

    with torch.no_grad():
        s = round_robin({"sliding": sliding, "dynamic": lambda: None}, rounds=rounds)
    print(
        f"attnlab sliding-window cache (window 64): {s['sliding']['median'] / steps * 1e3:.2f}"
        f" ms per step incl. prefill share"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", choices=["prefill", "weights", "decode"], default=None)
    p.add_argument("--memory-case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        run, setup, warm = weights_case(args.memory_case)
        report_peak(run, setup, warm)
        return
    rounds = 4 if args.quick else 10
    if args.only in (None, "prefill"):
        bench_prefill(rounds)
    if args.only in (None, "weights"):
        bench_weights(rounds)
    if args.only in (None, "decode"):
        bench_decode(rounds)


if __name__ == "__main__":
    main()
