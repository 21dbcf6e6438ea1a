"""Greedy decoding speed: attnlab's LlamaModel against Hugging Face's on the same random weights.

The model has SmolLM2-135M's shape (30 layers, d 576, 9 query / 3 key-value heads of 64, MLP
1536, vocabulary 49,152, tied embeddings) with random weights. Cases, in one process, timed
round-robin (one call of each per round):

  attnlab dynamic         LlamaModel.generate(cache="dynamic")
  attnlab static          LlamaModel.generate(cache=<StaticCache>), uncompiled
  attnlab static+compile  LlamaModel.generate(cache=<StaticCache>, compile=True): the compiled
                          decode step (on CUDA a CUDA graph)
  HF dynamic              generate() with its DynamicCache, attn_implementation="sdpa"
  HF static               generate(past_key_values=<StaticCache>, disable_compile=True), "sdpa":
                          uncompiled on every device (on CUDA Hugging Face would compile a
                          static-cache generate by itself)
  HF static+compile       the same compiled (on CPU by CompileConfig._compile_all_devices, as
                          Hugging Face's tests do; on CUDA as generate does by itself)
  HF static [attnlab]     HF static+compile with attn_implementation="attnlab"

and, for attnlab, a decode step with every layer's attention weights on request against the
step without them (eager, static cache; target <= 1.2x).

Each static case makes its cache once (for the prompt plus ``--new`` tokens) and resets it before
every generate: its storage keeps its addresses, so a compiled step's CUDA graph is recorded
once, not in every timed call (a cache made per call would be at new addresses).

Every case must produce the same greedy tokens as HF static (checked and printed; where
they differ, the first generated token that does, and whether it is a near tie: in bfloat16 a
tie between two tokens may be broken either way by rounding, as between HF's own compiled and
eager steps, so the two tokens' logits are compared in a float32 copy of the model against the
model's own bfloat16 logit error at that prefix). Figures:
tokens/s = B * new tokens / time of one generate (prefill included, as Hugging Face reports
it); ms/step = (time(new tokens) - time(1 token)) / (new tokens - 1), the decode step alone;
the ratios compare pairs of cases within one run (median and best of the rounds), compiled with
compiled and eager with eager first, each labelled. On CUDA, ``--attention`` profiles a few
steps of the uncompiled fast path and reports the share of GPU kernel time spent in
``aten::scaled_dot_product_attention`` (all it launched) and attnlab's Triton attention
kernels; on CPU the share of time in the attention operator.

Presets: CPU (default there): float32, batch 1 and 4, 128-token prompt, 64 new tokens.
``--config issue`` (default on CUDA): bfloat16, batch 4 and 1, 128- and 2048-token prompts,
128 new tokens (issue 11's configuration). ``--batch``, ``--prompt``, ``--new`` and ``--rounds``
override a preset: one configuration of it alone (a few minutes on an H100, so that each fits
one 10-minute command), e.g.

  python benchmarks/bench_decode.py --config issue --batch 4 --prompt 128 --attention

Each configuration's figures are printed (and flushed) as soon as it is done, with the time it
took.

Usage:
  python benchmarks/bench_decode.py [--device cpu|cuda] [--threads N] [--batch 1 4]
      [--prompt 128] [--new 64] [--dtype float32|bfloat16] [--config issue] [--rounds R]
      [--quick] [--attention] [--only attnlab|hf]

The first round compiles (tens of seconds per batch size on a 2-core CPU) and is not timed.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers  # noqa: E402

from attnlab.integrations.transformers import register  # noqa: E402
from attnlab.models import DecodeStep, LlamaModel  # noqa: E402
from attnlab.models.llama import CACHE_LENGTH_STEP  # noqa: E402
from common import device_sync  # noqa: E402

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# (first case, second case, what the ratio compares): like with like first
PAIRS = [
    ("attnlab static+compile", "HF static+compile", "both compiled"),
    ("attnlab static", "HF static", "both eager"),
    ("HF static [attnlab]", "HF static+compile", "attention inside HF, both compiled"),
    ("attnlab static+compile", "HF static", "compiled vs eager"),
    ("attnlab static+compile", "attnlab static", "attnlab's compiled step vs eager"),
    ("HF static+compile", "HF static", "HF's compiled step vs eager"),
]

SDPA_OPERATOR = "aten::scaled_dot_product_attention"
# attnlab's Triton attention kernels, by the names they run under (attnlab.kernels.triton_*)
TRITON_ATTENTION_KERNELS = {"_decode_kernel", "_forward_kernel"}
# on CPU: operators whose own time counts as attention
ATTENTION_KERNELS = re.compile(r"scaled_dot_product|flash|fmha|attention|sdpa", re.IGNORECASE)


def build_models(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMOLLM2_SHAPE)
    hf = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    ours = LlamaModel.from_hf(hf).to(device)
    return hf, ours


def static_length(total: int) -> int:
    """The static caches' slots, attnlab's and Hugging Face's alike: ``total`` rounded up as
    attnlab's ``generate(compile=True)`` rounds it (one compiled graph per length class)."""
    return -(-total // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def hf_case(
    hf, ids, impl: str, cache: str, compiled: bool, total: int
) -> Callable[[int], torch.Tensor]:
    """Hugging Face's greedy generate; a static cache made once for the case, reset per call.

    Compiled or not, whatever the device: ``disable_compile`` (since transformers 4.50) turns off
    the compilation that generate starts by itself on CUDA for a static cache, and
    ``_compile_all_devices`` turns it on on CPU. Generate would make a new StaticCache per call,
    at new addresses (marked static), and on CUDA its compiled step would record its CUDA graph
    again in every call; passing one cache (``past_key_values``, the name that every transformers
    5 accepts) and resetting it in place keeps its addresses, as attnlab's static cases do.
    """
    kw = {"disable_compile": not compiled}
    static = None
    if cache == "static":  # (as many slots as attnlab's: both attend over every slot)
        static = kw["past_key_values"] = transformers.StaticCache(
            config=hf.config, max_cache_len=static_length(total)
        )
    if compiled:
        config = transformers.CompileConfig()
        config._compile_all_devices = True  # Hugging Face compiles only on accelerators
        kw["compile_config"] = config

    def run(new: int) -> torch.Tensor:
        if static is not None:
            static.reset()
        if hf.config._attn_implementation != impl:  # (cases share the model; ~1 ms a call)
            hf.set_attn_implementation(impl)
        with warnings.catch_warnings():  # (newer versions call it `cache`, and say so each call)
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            return hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                **kw,
            )

    return run


def attnlab_case(
    ours, ids, cache: str, compiled: bool, total: int
) -> Callable[[int], torch.Tensor]:
    """attnlab's greedy generate; a static cache made once for the case, reset per call.

    The static cache has one length whatever ``new`` (rounded as ``generate(compile=True)``
    rounds it): one compiled graph. It is made once and reset before each call, not made per
    call: its storage is marked with ``mark_static_address``, and at new addresses the compiled
    step's CUDA graph would be recorded again in every call. (``generate(cache="static",
    compile=True)`` reuses a cache by itself, but only while the length stays: the timing
    alternates ``new`` tokens and 1, whose lengths differ.)
    """
    kind = cache
    if cache == "static":
        kind = ours.make_cache("static", static_length(total))

    def run(new: int) -> torch.Tensor:
        if cache == "static":
            kind.reset()  # storage kept, zeroed: the same addresses
        return ours.generate(ids, new, cache=kind, compile=compiled)

    return run


def cases_for(hf, ours, ids, new: int, only: str | None) -> dict:
    total = ids.shape[1] + new
    cases = {}
    if only in (None, "attnlab"):
        cases["attnlab dynamic"] = attnlab_case(ours, ids, "dynamic", False, total)
        cases["attnlab static"] = attnlab_case(ours, ids, "static", False, total)
        cases["attnlab static+compile"] = attnlab_case(ours, ids, "static", True, total)
    if only in (None, "hf"):
        cases["HF dynamic"] = hf_case(hf, ids, "sdpa", "dynamic", False, total)
        cases["HF static"] = hf_case(hf, ids, "sdpa", "static", False, total)
        cases["HF static+compile"] = hf_case(hf, ids, "sdpa", "static", True, total)
        cases["HF static [attnlab]"] = hf_case(hf, ids, "attnlab", "static", True, total)
    return cases


def time_cases(cases: dict, new: int, rounds: int, device: str) -> tuple[dict, dict]:
    """Round-robin: per round and case, generate `new` tokens, then 1 (the prefill + 1 step)."""
    sync = device_sync(device)
    tokens = {}
    for name, run in cases.items():  # warm-up: compiles, allocates caches, records tokens
        print(f"  warm-up {name} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        tokens[name] = run(new)
        run(1)
        sync()
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, dict[str, list[float]]] = {n: {"full": [], "step": []} for n in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            sync()
            t0 = time.perf_counter()
            run(new)
            sync()
            t1 = time.perf_counter()
            run(1)
            sync()
            t2 = time.perf_counter()
            times[name]["full"].append(t1 - t0)
            times[name]["step"].append(max(t1 - t0 - (t2 - t1), 0.0) / max(new - 1, 1))
    return times, tokens


def report(times: dict, tokens: dict, batch: int, new: int, judge=None) -> None:
    ref_name = "HF static" if "HF static" in tokens else next(iter(tokens))
    ref = tokens[ref_name]
    print(
        f"{'case':<26} {'tokens/s':>10} {'(best)':>8} {'ms/step':>9} {'(best)':>8}   "
        f"tokens = {ref_name}"
    )
    for name, t in times.items():
        full, step = statistics.median(t["full"]), statistics.median(t["step"])
        same = agreement(tokens[name].cpu(), ref.cpu(), new, judge)
        print(
            f"{name:<26} {batch * new / full:10.1f} {batch * new / min(t['full']):8.1f} "
            f"{step * 1e3:9.2f} {min(t['step']) * 1e3:8.2f}   {same}"
        )
    print("ratios (> 1: the first is faster): tokens/s, median (best); decode step, median")
    for a, b, what in PAIRS:
        if a in times and b in times:
            tput = statistics.median(times[b]["full"]) / statistics.median(times[a]["full"])
            best = min(times[b]["full"]) / min(times[a]["full"])
            steps = statistics.median(times[b]["step"]), statistics.median(times[a]["step"])
            # (a step's time is a difference of two timings: noise can leave nothing of it)
            step = f"x{steps[0] / steps[1]:.2f}" if min(steps) > 0 else "not measurable (noise)"
            print(f"  {a} / {b} ({what}): x{tput:.2f} (best x{best:.2f}); step {step}")
    sys.stdout.flush()  # this configuration's figures out now, whatever comes after


def agreement(got: torch.Tensor, ref: torch.Tensor, new: int, judge=None) -> str:
    """Say "yes" when two (B, T) greedy outputs (the last ``new`` tokens generated) are equal;
    else where they part, "NO from token t (r of B rows)", t the first generated token (from 1) that
    differs in any row, and what ``judge(prefix, token, other)`` says of that first parting (see
    :func:`tie_judge`). A parting at token 1 points at a different computation."""
    if torch.equal(got, ref):
        return "yes"
    if got.shape != ref.shape:
        return f"NO (shapes {tuple(got.shape)} vs {tuple(ref.shape)})"
    differs = (got != ref).any(0).nonzero()
    rows = int((got != ref).any(-1).sum())
    j = int(differs[0])  # the first column where some row parts
    first = j + 1 - (got.shape[-1] - new)
    said = f"NO from token {first} ({rows} of {got.shape[0]} rows)"
    if judge is not None:
        r = int((got[:, j] != ref[:, j]).nonzero()[0])
        said += judge(ref[r, :j], int(ref[r, j]), int(got[r, j]))
    return said


def tie_judge(hf) -> Callable[[torch.Tensor, int, int], str]:
    """Whether a parting of greedy tokens is a near tie broken by rounding: at the common prefix,
    the gap between the two tokens' logits in a float32 copy of the model, against the model's
    own logit error in its dtype there (max |logit - float32 logit| over the vocabulary, the
    control). A gap under that error is a tie the dtype cannot decide; a gap over it, a
    difference in computation to look into."""
    exact = {}

    def judge(prefix: torch.Tensor, token: int, other: int) -> str:
        if "model" not in exact:
            exact["model"] = copy.deepcopy(hf).float()
        ids = prefix[None].to(hf.device)
        with torch.no_grad():
            want = exact["model"](ids).logits[0, -1].float()
            have = hf(ids).logits[0, -1].float()
        gap = float((want[token] - want[other]).abs())
        error = float((have - want).abs().max())
        verdict = "a near tie" if gap <= error else "NOT a near tie: look into it"
        return f"; there float32 logits {gap:.2g} apart, {hf.dtype} error {error:.2g}: {verdict}"

    return judge


def weights_step(ours, ids, device: str, rounds: int, steps: int = 8) -> str:
    """A decode step of attnlab's model with every layer's attention weights (B, H, 1, S) on
    request, against the same step without (issue 11: <= 1.2x), eager, against a static cache
    (its empty slots masked), round-robin: each round times ``steps`` steps of each, the order
    alternating from round to round (the second of a pair ran measurably faster), and the
    ratio is the median of the rounds' ratios (a pair shares the machine's phase)."""
    sync = device_sync(device)
    rounds = max(rounds, 8)
    cache = ours.make_cache("static", ids.shape[1] + 2 * (rounds + 1) * steps)
    token = ids[:, -1:]
    times = {False: [], True: []}
    with torch.no_grad():
        ours(ids, cache=cache)
        for r in range(rounds + 1):
            for rw in (False, True) if r % 2 else (True, False):
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    ours(token, cache=cache, return_weights=rw)
                sync()
                if r:  # (round 0 warms up)
                    times[rw].append((time.perf_counter() - t0) / steps)
    plain, weighted = statistics.median(times[False]), statistics.median(times[True])
    ratio = statistics.median(w / p for w, p in zip(times[True], times[False], strict=True))
    best = min(times[True]) / min(times[False])
    return (
        f"weights at decode (attnlab static, eager, every layer's per-head weights): step "
        f"{weighted * 1e3:.2f} ms vs {plain * 1e3:.2f} ms without: x{ratio:.2f} (median of "
        f"{rounds} rounds' ratios; best x{best:.2f}; target <= 1.2)"
    )


def attention_share(ours, ids, device: str, new: int = 8) -> str:
    """Share of a decode step's time spent in attention, from the profiler's operator times."""
    from torch.profiler import ProfilerActivity, profile

    cache = ours.make_cache("static", ids.shape[1] + new + 1)
    step = DecodeStep(ours, compile=False)  # kernels named as they are: measurable
    with torch.no_grad():
        token = ours(ids, cache=cache)[:, -1:].argmax(-1)
        step(token, cache)  # warm
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(new):
                token = step(token, cache)[:, -1:].argmax(-1)
            device_sync(device)()
    events = prof.key_averages()
    if device == "cuda":
        attn, total, sdpa = gpu_attention_time(events)
        what = f"GPU kernel time (SDPA ran {', '.join(sdpa) or 'no aten kernel'})"
    else:
        total = sum(e.self_cpu_time_total for e in events)
        attn = sum(e.self_cpu_time_total for e in events if ATTENTION_KERNELS.search(e.key))
        what = "CPU operator time"
    if not total or not attn:
        return "attention share: not measurable (no attention kernel named in the profile)"
    return f"attention share of the uncompiled fast step: {100 * attn / total:.1f}% of {what}"


def gpu_attention_time(events) -> tuple[float, float, list[str]]:
    """(attention, total) GPU time in the profile's averaged events, and which implementations
    of torch's SDPA ran (its ``aten::_scaled_dot_product_*`` operators).

    Total: every kernel once, as its own device event (``self_device_time_total``; the CPU
    operators that launched kernels carry the same time again, so they are left out).
    Attention: ``aten::scaled_dot_product_attention`` with everything it launched
    (``device_time_total``), whichever kernels it picks -- flash, memory-efficient, cuDNN or the
    math fallback, whose kernels (matmuls, softmax) bear no attention name -- plus attnlab's own
    Triton attention kernels, which no aten operator launches.
    """
    kernels = [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    ]
    total = sum(e.self_device_time_total for e in kernels)
    attn = sum(e.device_time_total for e in events if e.key == SDPA_OPERATOR)
    attn += sum(e.self_device_time_total for e in kernels if e.key in TRITON_ATTENTION_KERNELS)
    sdpa = sorted(e.key for e in events if e.key.startswith("aten::_scaled_dot_product"))
    return attn, total, sdpa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--config", choices=["issue"], default=None, help="issue 11's GPU setup")
    p.add_argument("--batch", type=int, nargs="+", default=None)
    p.add_argument("--prompt", type=int, nargs="+", default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="fewer rounds and new tokens")
    p.add_argument("--attention", action="store_true", help="also profile the attention share")
    p.add_argument("--only", choices=["attnlab", "hf"], default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    issue = args.config == "issue" or (args.config is None and args.device == "cuda")
    batches = args.batch or ([4, 1] if issue else [1, 4])
    prompts = args.prompt or ([128, 2048] if issue else [128])
    new = args.new or (128 if issue else 64)
    dtype = getattr(torch, args.dtype or ("bfloat16" if issue else "float32"))
    rounds = args.rounds or (3 if args.quick else 5)
    if args.quick:
        new = min(new, 32)
    register()
    hf, ours = build_models(args.device, dtype)
    device_name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}, "
        f"{dtype}; random SmolLM2-135M-shaped Llama; greedy, {new} new tokens"
    )
    for prompt in prompts:
        for batch in batches:
            g = torch.Generator().manual_seed(batch * 10_000 + prompt)
            ids = torch.randint(100, 40_000, (batch, prompt), generator=g).to(args.device)
            print(f"\n== batch {batch}, prompt {prompt} tokens, {new} new ==", flush=True)
            start = time.perf_counter()
            cases = cases_for(hf, ours, ids, new, args.only)
            times, tokens = time_cases(cases, new, rounds, args.device)
            report(times, tokens, batch, new, tie_judge(hf))
            if args.only != "hf":
                print("  " + weights_step(ours, ids, args.device, rounds), flush=True)
            if args.attention:
                print("  " + attention_share(ours, ids, args.device))
            print(f"  (this configuration: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
