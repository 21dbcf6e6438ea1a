"""attnlab inside Hugging Face models: the registered attention function and whole-model prefill.

1. The attention functions alone, on the same inputs as SmolLM2's layers get them: query
   (B, 9, L, 64), key/value (B, 3, L, 64), float32, L = 256 and 1024, B = 4, causal, with the
   masks each implementation's registered mask function builds (bool for attnlab and sdpa,
   additive float for eager):
   * left padding (rows 1 and 3 padded by L/4): attnlab vs Llama's ``eager_attention_forward``
     and vs ``sdpa_attention_forward``, forward and forward+backward;
   * ``output_attentions=True`` (forward, no_grad): attnlab with weights vs eager;
   * no padding: the mask is None (torch's ``is_causal``) vs a materialised causal bool mask,
     the measurement behind registering ``sdpa_mask`` (which returns None there).
2. SmolLM2-135M prefill, batch 4 x 128 tokens, forward (no_grad) with attn_implementation eager /
   sdpa / attnlab, and with ``output_attentions=True`` (eager is the only HF option with weights).

Cases are timed round-robin in one process; the figures are medians and the ratios of medians
(and of bests) within one run. Ratio < 1: attnlab is faster.

Usage: ``python benchmarks/bench_hf.py [--quick] [--threads N] [--only functions|model]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from attnlab.integrations.transformers import attnlab_attention_forward, register  # noqa: E402
from common import header, ratio_line, round_robin  # noqa: E402

B, H, HKV, E = 4, 9, 3, 64  # SmolLM2's attention: 9 query heads, 3 key/value heads


class Layer(torch.nn.Module):
    """The attributes the attention functions read from the calling layer (LlamaAttention's)."""

    is_causal, num_key_value_groups, layer_idx = True, H // HKV, 0


def masks_for(L: int, padded: bool) -> dict[str, torch.Tensor | None]:
    """What each implementation's mask function gives for B sequences of length L."""
    real = torch.ones(B, L, dtype=torch.bool)
    if padded:
        real[1::2, : L // 4] = False  # left padding of rows 1 and 3
    kw = dict(
        batch_size=B,
        q_length=L,
        kv_length=L,
        mask_function=causal_mask_function,
        attention_mask=real,
    )
    return {
        "bool": sdpa_mask(**kw),  # (B, 1, L, L), None when there is no padding
        "dense": sdpa_mask(**kw, allow_is_causal_skip=False),  # always materialised
        "float": eager_mask(**kw, dtype=torch.float32),  # (B, 1, L, L), 0 / finfo.min
    }


def qkv(L: int, grad: bool = False):
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, L, E, generator=g)
    k, v = (torch.randn(B, HKV, L, E, generator=g) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def fwd_bwd(fn, *args, **kwargs):
    def run():
        out = fn(*args, **kwargs)[0]
        out.backward(torch.ones_like(out))

    return run


def bench_functions(rounds: int) -> None:
    layer, scaling = Layer().eval(), E**-0.5
    header("attention functions alone: B=4, H=9, Hkv=3, E=64, float32, causal")
    for L in (256, 1024):
        r = rounds if L <= 256 else max(3, rounds // 2)
        m = masks_for(L, padded=True)
        q, k, v = qkv(L)
        fns = {
            "attnlab": lambda: attnlab_attention_forward(
                layer, q, k, v, m["bool"], scaling=scaling
            ),
            "eager": lambda: eager_attention_forward(layer, q, k, v, m["float"], scaling=scaling),
            "sdpa": lambda: sdpa_attention_forward(layer, q, k, v, m["bool"], scaling=scaling),
        }
        with torch.no_grad():
            stats = round_robin(fns, rounds=r)
        print(ratio_line(f"fwd     L={L:<4} padded: attnlab / eager", stats, "attnlab", "eager"))
        print(ratio_line(f"fwd     L={L:<4} padded: attnlab / sdpa", stats, "attnlab", "sdpa"))

        qg, kg, vg = qkv(L, grad=True)
        fns = {
            "attnlab": fwd_bwd(
                attnlab_attention_forward, layer, qg, kg, vg, m["bool"], scaling=scaling
            ),
            "eager": fwd_bwd(
                eager_attention_forward, layer, qg, kg, vg, m["float"], scaling=scaling
            ),
            "sdpa": fwd_bwd(sdpa_attention_forward, layer, qg, kg, vg, m["bool"], scaling=scaling),
        }
        stats = round_robin(fns, rounds=r)
        print(ratio_line(f"fwd+bwd L={L:<4} padded: attnlab / eager", stats, "attnlab", "eager"))
        print(ratio_line(f"fwd+bwd L={L:<4} padded: attnlab / sdpa", stats, "attnlab", "sdpa"))

        fns = {
            "attnlab": lambda: attnlab_attention_forward(
                layer, q, k, v, m["bool"], scaling=scaling, output_attentions=True
            ),
            "eager": lambda: eager_attention_forward(layer, q, k, v, m["float"], scaling=scaling),
        }
        with torch.no_grad():
            stats = round_robin(fns, rounds=r)
        print(ratio_line(f"weights L={L:<4} padded: attnlab / eager", stats, "attnlab", "eager"))

        m = masks_for(L, padded=False)
        assert m["bool"] is None  # what sdpa_mask gives without padding
        fns = {
            "none": lambda: attnlab_attention_forward(layer, q, k, v, None, scaling=scaling),
            "dense": lambda: attnlab_attention_forward(layer, q, k, v, m["dense"], scaling=scaling),
        }
        with torch.no_grad():
            stats = round_robin(fns, rounds=r)
        print(ratio_line(f"fwd     L={L:<4} no pad: mask None / dense", stats, "none", "dense"))


def bench_model(rounds: int) -> None:
    from attnlab.pretrained import load_model

    header("SmolLM2-135M prefill, batch 4 x 128 tokens, float32, forward under no_grad")
    register()
    model, _ = load_model("smollm2", attn_implementation="eager")
    ids = torch.randint(100, 40000, (4, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def forward(impl: str, weights: bool = False):
        def run():
            model.set_attn_implementation(impl)
            out = model(input_ids=ids, attention_mask=mask, output_attentions=weights)
            assert (len(out.attentions) == 30) if weights else not out.attentions

        return run

    cases = {
        "eager": forward("eager"),
        "sdpa": forward("sdpa"),
        "attnlab": forward("attnlab"),
        "eager+weights": forward("eager", True),
        "attnlab+weights": forward("attnlab", True),
    }
    with torch.no_grad():
        stats = round_robin(cases, rounds=rounds, warmup=1)
    print(ratio_line("prefill: attnlab / eager", stats, "attnlab", "eager"))
    print(ratio_line("prefill: attnlab / sdpa", stats, "attnlab", "sdpa"))
    print(
        ratio_line("prefill, weights: attnlab / eager", stats, "attnlab+weights", "eager+weights")
    )
    print(
        ratio_line("prefill: attnlab with / without weights", stats, "attnlab+weights", "attnlab")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--only", choices=["functions", "model"], default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 4 if args.quick else 10
    if args.only in (None, "functions"):
        bench_functions(rounds)
    if args.only in (None, "model"):
        bench_model(max(3, rounds // 2))


if __name__ == "__main__":
    main()
