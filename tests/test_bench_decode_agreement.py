"""benchmarks/bench_decode.py's token check: where two greedy outputs part, and whether that
parting is a near tie that the model's dtype cannot decide (a float32 copy as the judge)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import bench_decode
finally:
    sys.path.pop(0)


def test_agreement_names_the_first_generated_token_that_parts_and_asks_the_judge():
    ref = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 1, 2, 3]])  # prompt of 2, then 3 new tokens
    got = ref.clone()
    assert bench_decode.agreement(got, ref, 3) == "yes"
    got[1, 3], got[0, 4] = 40, 41  # row 1 parts at generated token 2, row 0 at 3
    asked = []
    said = bench_decode.agreement(got, ref, 3, lambda *a: asked.append(a) or "; judged")
    assert said == "NO from token 2 (2 of 2 rows); judged"
    ((prefix, token, other),) = asked
    assert prefix.tolist() == [5, 6, 1] and (token, other) == (2, 40)


def tiny_llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def test_the_judge_tells_a_tie_from_a_real_difference():
    hf = tiny_llama(torch.bfloat16)
    prefix = torch.tensor([3, 17, 29, 8])
    judge = bench_decode.tie_judge(hf)
    with torch.no_grad():
        logits = copy.deepcopy(hf).float()(prefix[None]).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert judge(prefix, best, best).endswith(": a near tie")  # 0 apart: within any error
    assert "NOT a near tie" in judge(prefix, best, worst)  # the whole logit range apart


def test_weights_step_times_a_step_with_and_without_weights():
    from attnlab.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64)).eval()  # fmt: skip
    said = bench_decode.weights_step(model, torch.randint(0, 64, (2, 5)), "cpu", rounds=2, steps=2)
    assert said.startswith("weights at decode") and "target <= 1.2" in said
    ratio = float(said.split(": x")[1].split(" ")[0])
    assert 0 < ratio < 100
