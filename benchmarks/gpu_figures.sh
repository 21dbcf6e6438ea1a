#!/usr/bin/env bash
# Every GPU figure the open issues ask for, in parts that each fit one 10-minute call on a lent
# GPU machine (whose python3 has torch, triton and transformers; attnlab runs from src/). Each
# part stops its steps in time (BUDGET seconds in all, 570 by default): a step gets what is
# left, and a step with no time left is skipped and says so. Logs go to $OUT (the device
# tool's folder that comes back) or ./gpu-logs, one per step, written as the step runs.
#
#   bash benchmarks/gpu_figures.sh 1   # kernels' results vs float64, then bench_gpu.py (issue 9),
#                                      # with the kernels' tiles swept
#   bash benchmarks/gpu_figures.sh 2   # additive kernel and its tilings (issue 9, item 3)
#   bash benchmarks/gpu_figures.sh 3   # decoding vs Hugging Face, issue 11's setup; weights at
#                                      # decode; DecodeStep
#   bash benchmarks/gpu_figures.sh 4   # decoding at batch 1 and a 2,048-token prompt; beam
#   bash benchmarks/gpu_figures.sh 0   # one call for a single lease: what changed since the
#                                      # last figures (issue 11's decode table), then the check
#
# In order of need: 1 first (gpu_check.py must pass before any timing means anything), then 3
# and 2; 4 when device time is left. A lease of one call (15 minutes of device time, a start
# included) takes 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs="${OUT:-gpu-logs}"
mkdir -p "$logs"
py=${PYTHON:-python3}
deadline=$((SECONDS + ${BUDGET:-570}))
run() {  # name, command...: one log per step; a failing step does not stop the others
    local name=$1
    shift
    local left=$((deadline - SECONDS)) limit=${STEP_LIMIT:-540}
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: skipped (${left}s of the part's budget left)" | tee "$logs/$name.log"
        return
    fi
    echo "== $name: $* (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv,noheader || true
"$py" -c 'import sys, torch, triton, transformers as t
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", t.__version__)' 2>&1 | tee "$logs/versions.log"
case "${1:-}" in
0)  # (for the next lease: what changed since the H200 figures of 2026-11-28, in
    # benchmarks/results/h200-2026-11-28. Key padding in 16 bits now goes to FlexAttention with
    # attnlab's block mask (attnlab.kernels.flex_padding, checked on CPU only): gpu_check's
    # check_flex first, then the padding rows (issue 9's target: no slower than Flex). The eager
    # prefill now reads a static cache's filled slots alone, which capped generate(compile=True)
    # at x1.25 of HF's tokens/s there while its step ran at x2.10: issue 11's table after.
    # The weights with torch's flash kernel as their first pass (TORCH_PASS1_ON, off until
    # timed): gpu_check's check_torch_pass1, and its rows in the weights section. The additive
    # kernels now keep the forward's scores for the backward and, in bfloat16, take the SFU's
    # tanh.approx.f32 (both checked by gpu_check against float64; the additive rows time each
    # against the other form: issue 9's 5x target).)
    STEP_LIMIT=200 run gpu_check "$py" benchmarks/gpu_check.py
    STEP_LIMIT=110 run bench_gpu_additive "$py" benchmarks/bench_gpu_additive.py
    STEP_LIMIT=130 run bench_gpu_padding "$py" benchmarks/bench_gpu.py --only padding
    STEP_LIMIT=80 run bench_gpu_weights "$py" benchmarks/bench_gpu.py --only weights
    run bench_decode "$py" benchmarks/bench_decode.py --config issue --batch 4 --prompt 128 \
        --quick  # (as it goes)
    ;;
1)
    run gpu_check "$py" benchmarks/gpu_check.py
    STEP_LIMIT=150 run bench_gpu_weights "$py" benchmarks/bench_gpu.py --only weights --sweep
    run bench_gpu_overhead "$py" benchmarks/bench_gpu.py --only overhead
    STEP_LIMIT=240 run bench_gpu_padding "$py" benchmarks/bench_gpu.py --only padding --sweep
    run bench_gpu_structure "$py" benchmarks/bench_gpu.py --only structure  # (as it goes)
    ;;
2)
    run bench_gpu_additive "$py" benchmarks/bench_gpu_additive.py --sweep
    ;;
3)
    STEP_LIMIT=420 run bench_decode "$py" benchmarks/bench_decode.py --config issue --batch 4 \
        --prompt 128 --attention
    STEP_LIMIT=60 run bench_gpu_decode "$py" benchmarks/bench_gpu.py --only decode
    run bench_decode_step "$py" benchmarks/bench_decode_step.py
    ;;
4)
    STEP_LIMIT=240 run bench_decode_batch1 "$py" benchmarks/bench_decode.py --config issue \
        --batch 1 --prompt 128
    STEP_LIMIT=240 run bench_decode_prompt2048 "$py" benchmarks/bench_decode.py --config issue \
        --batch 4 --prompt 2048
    run bench_beam "$py" benchmarks/bench_beam.py
    ;;
*)
    echo "usage: bash benchmarks/gpu_figures.sh 0|1|2|3|4" >&2
    exit 2
    ;;
esac
