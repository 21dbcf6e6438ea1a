#!/usr/bin/env bash
# Every GPU figure the open issues ask for, in three parts that each fit a 10-minute call on a
# lent GPU machine (whose python3 has torch, triton and transformers; attnlab runs from src/).
# Logs go to $OUT (the device tool's folder that comes back) or ./gpu-logs.
#
#   bash benchmarks/gpu_figures.sh 1   # kernels' results vs float64, then bench_gpu.py (issue 9)
#   bash benchmarks/gpu_figures.sh 2   # additive kernel tilings (issue 9, item 3)
#   bash benchmarks/gpu_figures.sh 3   # decoding vs Hugging Face, compiled steps (issue 11)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs="${OUT:-gpu-logs}"
mkdir -p "$logs"
py=${PYTHON:-python3}
run() {  # name, command...: one log per step; a failing step does not stop the others
    local name=$1
    shift
    echo "== $name: $*"
    timeout "${STEP_LIMIT:-540}" "$@" 2>&1 | tee "$logs/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
case "${1:-}" in
1)
    run gpu_check "$py" benchmarks/gpu_check.py
    run bench_gpu "$py" benchmarks/bench_gpu.py --only weights
    run bench_gpu_padding "$py" benchmarks/bench_gpu.py --only padding
    run bench_gpu_overhead "$py" benchmarks/bench_gpu.py --only overhead
    ;;
2)
    run bench_gpu_additive "$py" benchmarks/bench_gpu_additive.py --sweep
    ;;
3)
    STEP_LIMIT=240 run bench_decode "$py" benchmarks/bench_decode.py --config issue --attention
    STEP_LIMIT=120 run bench_decode_step "$py" benchmarks/bench_decode_step.py
    STEP_LIMIT=180 run bench_beam "$py" benchmarks/bench_beam.py
    ;;
*)
    echo "usage: bash benchmarks/gpu_figures.sh 1|2|3" >&2
    exit 2
    ;;
esac
