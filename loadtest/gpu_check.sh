#!/usr/bin/env bash
# The checks only a GPU can run, in one go on a CUDA machine whose python3 already holds torch,
# triton and transformers (the project's other packages come as wheels in $WHEELS, if set):
#
#   1. the kernel tests and the tiny-model engine tests on CUDA (compiled Triton kernels, the
#      engine's logits against transformers' on the GPU, batching, preemption by swap to host
#      memory and recompute, KV export and import);
#   2. with a GGUF model (argument 2): the real model's greedy tokens against transformers'
#      `generate` on the GPU, the engine benchmark in float32 and bfloat16, and the pipeline
#      benchmark (transformers static batching, the bare engine, `tandem up --device cuda`),
#      and the decode step replayed from CUDA graphs against the eager one at batch 1, 8, 64 and
#      256 (`engine_bench --cuda-graphs`: step times side by side, and the same greedy tokens).
#
#   bash loadtest/gpu_check.sh OUT_DIR [GGUF_OR_MODEL_DIR]
#
# Every step writes its log and JSON under OUT_DIR and the script goes on past a failed step;
# its exit status is the number of failed steps. A step that would start after BUDGET_S seconds
# (default 540) is skipped, so the whole run fits a rented machine's time. SKIP_TINY=1 skips step
# 1 (already run). DEVICE=cpu runs the same steps on a CPU (with smaller benchmarks), to try the
# script where there is no GPU.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [GGUF_OR_MODEL_DIR]}
model=${2:-}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TANDEM_TEST_DEVICE=$device
budget=${BUDGET_S:-540}
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run with a limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ "$SECONDS" -ge "$budget" ]; then
        echo "== $name: skipped, past the ${budget} s budget"
        failed=$((failed + 1))
        return
    fi
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tandem-site "$WHEELS"/*.whl || exit 99
    export PYTHONPATH=/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null | tee "$out/gpu.txt"
"$py" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' \
    | tee -a "$out/gpu.txt"

pytest=("$py" -m pytest -q -p no:cacheprovider -o addopts="-ra")
if [ -z "${SKIP_TINY:-}" ]; then
    step tests_kernels_tiny 600 "${pytest[@]}" tests/kernels tests/engine/test_model_vs_hf.py \
        tests/engine/test_engine.py
fi

if [ -z "$model" ]; then
    exit "$failed"
fi
if [ "$device" = cpu ]; then
    head -n 6 loadtest/workloads/mixed64.jsonl >"$out/small.jsonl"
    sizes=1,8 graph_sizes=1,8 repeats=3 workload=(--workload "$out/small.jsonl" --burst)
else
    sizes=1,8,32,64,256 graph_sizes=1,8,64,256 repeats=20
    workload=(--workload loadtest/workloads/mixed64.jsonl --burst)
fi
step convert 600 "$py" -c "from shared.engine.loader import resolve_model_dir as r; print(r('$model'))"
TANDEM_TEST_MODEL=$model step tests_smollm2_greedy 600 "${pytest[@]}" \
    tests/engine/test_smollm2_greedy.py
for dtype in float32 bfloat16; do
    step "engine_bench_$dtype" 600 "$py" -m loadtest.engine_bench --model "$model" \
        --device "$device" --dtype "$dtype" --batch-sizes "$sizes" --repeats "$repeats" \
        --json "$out/engine_bench_$dtype.json"
done
step engine_bench_cuda_graphs 600 "$py" -m loadtest.engine_bench --model "$model" \
    --device "$device" --dtype bfloat16 --batch-sizes "$graph_sizes" --repeats "$repeats" \
    --cuda-graphs --json "$out/engine_bench_cuda_graphs.json"
for dtype in float32 bfloat16; do
    step "pipeline_bench_$dtype" 900 "$py" -m loadtest.pipeline_bench --model "$model" \
        --device "$device" --dtype "$dtype" "${workload[@]}" --json "$out/pipeline_$dtype.json"
done
exit "$failed"
