#!/usr/bin/env bash
# Nsight Compute on the Hopper kernel's three kernels, packed documents against dense
# causal (issue 41): warp stall reasons, issue rates and throughput per kernel.
#
#   bash benchmarks/packed_ncu.sh [SEQ]     # one Hopper GPU with ncu on the PATH -> $OUT
#
# Each run profiles the second fwd+bwd call of benchmarks/packed_ncu.py (its first call
# compiles and warms): three kernels named entry_mosaic_gpu_kernel (forward, dK/dV, dQ).
set -euo pipefail
seq=${1:-16384}
OUT=$(realpath -m "${OUT:-benchmarks/out}")
mkdir -p "$OUT"
cd "$(dirname "$0")"
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)}
if [ -z "$NCU" ]; then
  echo "packed_ncu.sh: no ncu here (set NCU=/path/to/ncu)" >&2
  exit 2
fi
sections=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
          --section Occupancy --section LaunchStats)
for kind in packed dense; do
  flag=$([ "$kind" = dense ] && echo --dense || true)
  timeout "${NCU_S:-240}" "$NCU" --target-processes all -k regex:entry_mosaic_gpu_kernel \
      --launch-skip 3 --launch-count 3 "${sections[@]}" -f -o "$OUT/ncu_${kind}_$seq" \
      python packed_ncu.py --seq "$seq" $flag 2>&1 | tail -5
  "$NCU" --import "$OUT/ncu_${kind}_$seq.ncu-rep" --page details --print-units base \
      > "$OUT/ncu_${kind}_$seq.txt" 2>&1 || true
done
