#!/usr/bin/env bash
# Issue 42: the mesh roles measured on one node of 2 (or 4) GPUs, one phase per device call.
#
#   bash benchmarks/nd_mesh_gpu.sh train 32768 1b,7b attention_mlp 3   # LEN SIZES REMAT STEPS
#   bash benchmarks/nd_mesh_gpu.sh train 131072 1b full 2
#   bash benchmarks/nd_mesh_gpu.sh train 131072 7b full 1
#   bash benchmarks/nd_mesh_gpu.sh generate 7b:32768:1,7b:131072:1
#   (here: python benchmarks/nd_mesh.py --report benchmarks/results/nd_mesh_gpu/RUN)
#
# train: for each size and each mesh of MESHES (default data=G, sequence=G, tensor=G,
#   fsdp=G), one process of `train_mfu.py --batch G` (G sequences of LEN tokens per step on
#   every mesh: the same work, so the rows compare as they are), each in its own process so
#   that its peak memory is its own; each row carries choose_mesh's modeled step time and
#   memory for its mesh (`train_mfu.py --mesh`).
# generate: `generate.py --mesh "none;tensor=G"`: the one-axis model (the cache over the G
#   devices, weights replicated) against the weights over the tensor axis, in one process.
#
# BUDGET_S (default 540): no new process starts after that many seconds of the phase.  The
# JSONs and logs are packed into $OUT/nd_<phase>_<tag>.tgz after every row (the device
# tool brings back at most 8 files).  DRY=1: a CPU dry run (8 simulated devices, the tiny
# shape, float32).
set -uo pipefail
phase=${1:?train LEN SIZES REMAT STEPS | generate CONFIGS}
OUT=$(realpath -m "${OUT:-benchmarks/out}")
mkdir -p "$OUT"
cd "$(dirname "$0")"
G=${GPUS:-2}
BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-python}
start=$SECONDS
if [ -n "${DRY:-}" ]; then
    export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8
    preset=(--preset cpu)
else
    preset=(--preset gpu)
fi
export PYTHONUNBUFFERED=1

pack() {  # $1: the rows' folder
    tar czf "$OUT/nd_$(basename "$1").tgz" -C "$(dirname "$1")" "$(basename "$1")"
}

case "$phase" in
train)
    len=${2:?LEN}; sizes=${3:?SIZES}; remat=${4:?REMAT}; steps=${5:?STEPS}
    meshes=${MESHES:-data=$G;sequence=$G;tensor=$G;fsdp=$G}
    rows=/tmp/nd_rows/train_${len}_${sizes//,/-}
    mkdir -p "$rows"
    for size in ${sizes//,/ }; do
        IFS=';' read -ra list <<< "$meshes"
        for mesh in "${list[@]}"; do
            tag="${size}_${len}_${mesh//[=,]/}"
            if (( SECONDS - start > BUDGET_S )); then
                echo "skipped $tag: BUDGET_S=$BUDGET_S spent" | tee -a "$rows/skipped.txt"
                continue
            fi
            [ -n "${DRY:-}" ] && size_arg=tiny || size_arg=$size
            OUT=$rows "$PY" -X faulthandler train_mfu.py "${preset[@]}" --sizes "$size_arg" \
                --devices "$G" --seq "$len" --batch "$G" --mesh "$mesh" --remat "$remat" \
                --steps "$steps" --scan-layers --tag "$tag" 2>&1 \
                | grep -v "^WARNING\|UserWarning\|warnings.warn" | tee "$rows/$tag.log"
            echo "# $tag done at $((SECONDS - start)) s" | tee -a "$rows/$tag.log"
            pack "$rows"
        done
    done
    ;;
generate)
    configs=${2:?CONFIGS}
    rows=/tmp/nd_rows/generate
    mkdir -p "$rows"
    extra=()
    [ -n "${DRY:-}" ] && extra=(--dry-run)
    OUT=$rows "$PY" -X faulthandler generate.py "${extra[@]}" --devices "$G" \
        --configs "$configs" --mesh "${MESHES:-none;tensor=$G}" --scan-layers on \
        --strategies "" --no-baseline --new-tokens "${NEW_TOKENS:-64}" \
        --budget-s "$BUDGET_S" --name "generate_nd" 2>&1 \
        | grep -v "^WARNING\|UserWarning\|warnings.warn" | tee "$rows/generate.log"
    pack "$rows"
    ;;
*)
    echo "unknown phase $phase: train LEN SIZES REMAT STEPS | generate CONFIGS" >&2
    exit 2
    ;;
esac
echo "# phase $phase: $((SECONDS - start)) s"
