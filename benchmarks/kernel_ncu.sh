#!/usr/bin/env bash
# Nsight Compute on one call of a Hopper attention kernel (issue 41): SM and tensor-core
# use, issue rate and warp stalls per kernel, from benchmarks/kernel_ncu.py.
#
#   bash benchmarks/kernel_ncu.sh NAME [kernel_ncu.py args]   # -> $OUT/ncu_NAME.txt
#
# kernel_ncu.py calls the kernels twice (the first compiles); ncu skips the first call's
# kernels and profiles the second's (all named *mosaic_gpu_kernel: this library's and
# tokamax's).  SECTIONS overrides the default sections; NCU the ncu binary.  The report's
# import has a limit too (IMPORT_S, 120 s): after ncu crashed mid-profile on an H200, the
# command went on until the device call's own limit (RESULTS.md, 2026-11-28).
set -euo pipefail
name=${1:?a name for the report}
shift
OUT=$(realpath -m "${OUT:-benchmarks/out}")
mkdir -p "$OUT"
cd "$(dirname "$0")"
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)}
if [ -z "$NCU" ]; then
  echo "kernel_ncu.sh: no ncu here (set NCU=/path/to/ncu)" >&2
  exit 2
fi
n=$(python kernel_ncu.py --kernels-per-call "$@" 2>/dev/null | tail -1)
default="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
if [ "${MIX:-0}" = 1 ]; then
  default="--metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,sm__cycles_active.avg,gpu__time_duration.sum"
fi
read -r -a sections <<< "${SECTIONS:-$default}"
timeout "${NCU_S:-240}" "$NCU" --target-processes all -k regex:mosaic_gpu_kernel \
    --launch-skip "$n" --launch-count "$n" "${sections[@]}" -f -o "$OUT/ncu_$name" \
    python kernel_ncu.py "$@" 2>&1 | tail -3
if [ "${MIX:-0}" = 1 ]; then
  timeout "${IMPORT_S:-120}" "$NCU" --import "$OUT/ncu_$name.ncu-rep" --page raw --csv \
      --print-units base --print-metric-instances details > "$OUT/mix_$name.csv" 2>&1 || true
else
  timeout "${IMPORT_S:-120}" "$NCU" --import "$OUT/ncu_$name.ncu-rep" --page details \
      --print-units base > "$OUT/ncu_$name.txt" 2>&1 || true
fi
rm -f "$OUT/ncu_$name.ncu-rep"
