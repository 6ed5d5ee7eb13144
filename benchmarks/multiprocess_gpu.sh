#!/usr/bin/env bash
# Several processes on one machine with >= 2 GPUs: one GPU per process, NCCL between them.
#
#   bash benchmarks/multiprocess_gpu.sh                # 2 processes x 1 GPU
#   NUM_PROCESSES=4 bash benchmarks/multiprocess_gpu.sh
#   TRAIN_CMD="python examples/train.py --steps 20" bash benchmarks/multiprocess_gpu.sh
#
# 1. `python -m jax_seqpar demo` (float32 and bfloat16) launched as NUM_PROCESSES
#    processes with one GPU each: ring vs all-gather attention on a mesh spanning all
#    processes, checked against the dense reference on process 0.
# 2. tests/mp_worker_attention.py and tests/mp_worker_train.py (ring attention outputs and
#    gradients; one AdamW step of a small model) launched the same way, and again as one
#    process that sees the same GPUs; the results of the two runs are compared.
# 3. If TRAIN_CMD is set: that command (e.g. the training example) under the launcher.
#
# Logs and .npz files go to benchmarks/results/multiprocess_<N>x<platform>/.  Exit code 0
# only if every step passed.  Dry run on a CPU-only machine (simulated devices):
#   DEVICES_PER_PROCESS=4 DEMO_ARGS="--seq-len 1024" bash benchmarks/multiprocess_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
N=${NUM_PROCESSES:-2}
TIMEOUT=${TIMEOUT:-900}
DEMO_ARGS=${DEMO_ARGS:-}
if [[ -n "${DEVICES_PER_PROCESS:-}" ]]; then  # CPU dry run
    PER_PROCESS=(--devices-per-process "$DEVICES_PER_PROCESS")
    export JAX_PLATFORMS=cpu
    SINGLE_ENV=(env "XLA_FLAGS=--xla_force_host_platform_device_count=$((N * DEVICES_PER_PROCESS))")
    TAG="${N}xcpu"
else
    PER_PROCESS=(--gpus-per-process 1)
    GPUS=$(seq -s, 0 $((N - 1)))
    SINGLE_ENV=(env "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$GPUS}")
    TAG="${N}xgpu"
fi
OUT=benchmarks/results/multiprocess_$TAG
mkdir -p "$OUT"
LAUNCH=("$PY" -m jax_seqpar launch --num-processes "$N" "${PER_PROCESS[@]}" --timeout "$TIMEOUT" --)
failed=()

step() {  # step NAME COMMAND...: run, tee the log, remember failures
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | grep -v '^\[p[0-9]*\] \[Gloo\]' | tee "$OUT/$name.log"
    local code=${PIPESTATUS[0]}
    [[ $code -eq 0 ]] || { echo "=== $name FAILED (exit code $code)"; failed+=("$name"); }
}

step info "${LAUNCH[@]}" "$PY" -m jax_seqpar info
for dtype in float32 bfloat16; do
    # shellcheck disable=SC2086
    step "demo_$dtype" "${LAUNCH[@]}" "$PY" -m jax_seqpar demo --dtype "$dtype" $DEMO_ARGS
done
for worker in attention train; do
    step "${worker}_${N}proc" "${LAUNCH[@]}" "$PY" "tests/mp_worker_$worker.py" "$OUT/${worker}_${N}proc.npz"
    step "${worker}_1proc" "${SINGLE_ENV[@]}" "$PY" "tests/mp_worker_$worker.py" "$OUT/${worker}_1proc.npz"
done

echo "=== compare: $N processes vs 1 process on the same devices"
"$PY" - "$OUT" "$N" <<'EOF' 2>&1 | tee "$OUT/compare.log"
import sys
import numpy as np
out, n = sys.argv[1], sys.argv[2]
worst = 0.0
for worker in ("attention", "train"):
    try:
        a = np.load(f"{out}/{worker}_{n}proc.npz")
        b = np.load(f"{out}/{worker}_1proc.npz")
    except OSError as e:
        print(f"{worker}: missing results ({e})")
        worst = float("inf")
        continue
    print(f"{worker}: {int(a['process_count'])} processes vs {int(b['process_count'])}")
    for key in sorted(a.files):
        if not np.issubdtype(a[key].dtype, np.floating):
            continue  # counts and flags
        x, y = np.asarray(a[key], np.float64), np.asarray(b[key], np.float64)
        rel = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        worst = max(worst, rel)
        print(f"  {key:<28} max |diff| {np.abs(x - y).max():.2e}  relative {rel:.2e}")
print(f"worst relative difference {worst:.2e}: {'PASS' if worst <= 1e-5 else 'FAIL'} (budget 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
EOF
[[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=(compare)

if [[ -n "${TRAIN_CMD:-}" ]]; then
    # shellcheck disable=SC2086
    step train_example "${LAUNCH[@]}" $TRAIN_CMD
fi

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED: ${failed[*]} (logs in $OUT)"
    exit 1
fi
echo "all passed (logs in $OUT)"
