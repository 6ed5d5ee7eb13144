#!/usr/bin/env bash
# Issue 41 on one Hopper GPU through the device tool, one phase per call:
#
#   bash benchmarks/hopper_tiles_gpu.sh tune 128     # mgpu_tune.py for head dim 128 -> $OUT
#   bash benchmarks/hopper_tiles_gpu.sh tune 64      # (MASKS=none,causal PHASES=fwd ... to narrow)
#   bash benchmarks/hopper_tiles_gpu.sh check RUN    # kernels.py check of the table's configs
#                                                    # (KERNELS=pallas_mgpu,NAME VARIANTS=NAME:...
#                                                    # checks a variant beside them; CASES=a,b
#                                                    # narrows the cases; DTYPES=a,b
#                                                    # the dtypes, bfloat16 by default)
#   (here: python benchmarks/mgpu_tune.py --merge tune_d*.json --table jax_seqpar/kernels/mgpu_tuned.json)
#   bash benchmarks/hopper_tiles_gpu.sh pair RUN     # kernels.py pair at 16k and 64k -> $OUT
#   (KERNELS=tokamax_direct,pallas_mgpu,lists VARIANTS=lists:index_tiles=false ... pair RUN
#    adds a variant of the defaults to the same run)
#   bash benchmarks/hopper_tiles_gpu.sh auto RUN     # auto_order.py: which backend `auto`
#                                                    # should try first, model-shaped calls
#   bash benchmarks/hopper_tiles_gpu.sh breakdown RUN  # kernels.py breakdown: each kernel
#                                                    # of one fwd+bwd call per backend
#   bash benchmarks/hopper_tiles_gpu.sh packed RUN   # packed_batch.py at 64k, documents of
#                                                    # DOC_LENS (4096); VARIANTS as for pair;
#                                                    # PER_KERNEL="call,call" its --kernels
#   bash benchmarks/hopper_tiles_gpu.sh ptxas RUN    # ptxas's registers, spills and wgmma
#                                                    # serialization (C7513) per kernel, for
#                                                    # each config of SETS="a:f=v b:" (b:
#                                                    # the table's), 4k packed by default
#
# The pair, auto and breakdown phases (and check, when KERNELS names tokamax) install
# tokamax 0.0.17 and its dependencies from wheels carried in .whl/tokamax (the GPU machine
# has no network) and put an empty stand-in for `xprof` on the path: tokamax imports it at
# import time for its own benchmarking module only.
set -euo pipefail
phase=${1:?tune DIM | check RUN | pair RUN | auto RUN | breakdown RUN | packed RUN | ptxas RUN}
OUT=$(realpath -m "${OUT:-benchmarks/out}")
export OUT
mkdir -p "$OUT"
cd "$(dirname "$0")"

with_tokamax() {
  if [ -d ../.whl/tokamax ] && [ ! -d /tmp/tk/tokamax ]; then
    pip install --quiet --no-deps --no-index --target /tmp/tk ../.whl/tokamax/*.whl
  fi
  mkdir -p /tmp/tk_stub/xprof/cli/tools
  touch /tmp/tk_stub/xprof/__init__.py /tmp/tk_stub/xprof/cli/__init__.py \
      /tmp/tk_stub/xprof/cli/tools/__init__.py \
      /tmp/tk_stub/xprof/cli/tools/get_kernel_stats_tool.py
  export PYTHONPATH="/tmp/tk:/tmp/tk_stub${PYTHONPATH:+:$PYTHONPATH}"
}

with_flash_attn() {  # flash-attn-jax packed here by carry_flash_attn.sh (carry .carry)
  if [ ! -d /tmp/fa/site ]; then
    rm -rf /tmp/fa && cp -r ../.carry/flash_attn /tmp/fa
    find /tmp/fa -name '*.xz' -exec xz -d {} +
  fi
  export PYTHONPATH="/tmp/fa/site${PYTHONPATH:+:$PYTHONPATH}"
  export LD_LIBRARY_PATH="/tmp/fa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

case "$phase" in
tune)
    dim=${2:?head dim}
    tag=${TAG:-d$dim}
    timeout "${TUNE_S:-500}" python -X faulthandler mgpu_tune.py --dims "$dim" \
        --masks "${MASKS:-none,causal,segments}" --phases "${PHASES:-fwd,bwd}" \
        --rounds "${ROUNDS:-7}" --out "$OUT/tune_$tag.json" 2>&1 | tee "$OUT/tune_$tag.log"
    ;;
check)
    run=${2:?run name}
    case ",${KERNELS:-}," in *,tokamax,*) with_tokamax ;; esac
    case ",${KERNELS:-}," in *,flash_attn,*) with_flash_attn ;; esac
    variants=()
    for v in ${VARIANTS:-}; do variants+=(--mgpu-variant "$v"); done
    status=0  # a run stopped by its limit keeps the cases it checked (saved per case)
    timeout "${CHECK_S:-300}" python kernels.py --phases check "${variants[@]}" \
        ${CASES:+--cases "$CASES"} \
        --check-kernels "${KERNELS:-pallas_mgpu}" --dims "${DIMS:-64,128}" \
        --dtypes "${DTYPES:-bfloat16}" 2>&1 | tee "$OUT/check_$run.log" || status=$?
    mv "$OUT/kernels_gpu.json" "$OUT/check_$run.json"
    exit "$status"
    ;;
pair)
    run=${2:?run name}
    with_tokamax
    variants=()  # VARIANTS="name:field=value,... name2:...": pallas_mgpu variants to add
    for v in ${VARIANTS:-}; do variants+=(--mgpu-variant "$v"); done
    timeout "${PAIR_S:-560}" python kernels.py --phases pair "${variants[@]}" \
        --bench-kernels "${KERNELS:-tokamax_direct,pallas_mgpu,pallas_mgpu_untuned}" \
        --sizes "${SIZES:-16384,65536}" --bench-dims "${DIMS:-128,64}" \
        --rounds "${PAIR_ROUNDS:-8}" --device-rounds "${DEVICE_ROUNDS:-7}" \
        2>&1 | tee "$OUT/pair_$run.log"
    mv "$OUT/kernels_gpu.json" "$OUT/pair_$run.json"
    ;;
auto)  # auto_order.py: cuDNN / pallas_mgpu / tokamax / auto through jax_seqpar.attention
    run=${2:?run name}
    with_tokamax
    timeout "${AUTO_S:-560}" python auto_order.py --rounds "${PAIR_ROUNDS:-8}" \
        --device-rounds "${DEVICE_ROUNDS:-5}" ${SHAPES:+--shapes "$SHAPES"} 2>&1 \
        | tee "$OUT/auto_$run.log"
    mv "$OUT/auto_order.json" "$OUT/auto_$run.json"
    ;;
breakdown)
    run=${2:?run name}
    with_tokamax
    variants=()
    for v in ${VARIANTS:-}; do variants+=(--mgpu-variant "$v"); done
    timeout "${PAIR_S:-560}" python kernels.py --phases breakdown "${variants[@]}" \
        --bench-kernels "${KERNELS:-tokamax_direct,pallas_mgpu}" \
        --sizes "${SIZES:-16384,65536}" --bench-dims "${DIMS:-128,64}" \
        --device-rounds "${DEVICE_ROUNDS:-5}" 2>&1 | tee "$OUT/breakdown_$run.log"
    mv "$OUT/kernels_gpu.json" "$OUT/breakdown_$run.json"
    ;;
packed)
    run=${2:?run name}
    variants=()
    for v in ${VARIANTS:-}; do variants+=(--mgpu-variant "$v"); done
    timeout "${PACKED_S:-560}" python packed_batch.py "${variants[@]}" \
        ${PER_KERNEL:+--kernels "$PER_KERNEL"} \
        --doc-lens "${DOC_LENS:-4096}" --rounds "${PAIR_ROUNDS:-7}" \
        --device-rounds "${DEVICE_ROUNDS:-5}" 2>&1 | tee "$OUT/packed_$run.log"
    mv "$OUT/packed_batch.json" "$OUT/packed_$run.json"
    ;;
ptxas)  # ptxas's report of each kernel of one call: registers, spills, and whether it
        # serialized the wgmma pipeline (C7513), per config in SETS="name:field=value,...
        # name2:..." ("default:" = the table's config); kernel_ncu.py's call, SEQ / MASK /
        # TILE / FWD_ONLY=1 narrowing it
    run=${2:?run name}
    : > "$OUT/ptxas_$run.txt"
    for spec in ${SETS:-default:}; do
        name=${spec%%:*}
        fields=${spec#*:}
        sets=()
        IFS=, read -ra pairs <<< "$fields"
        for f in "${pairs[@]}"; do [ -n "$f" ] && sets+=(--set "$f"); done
        dump=$(mktemp -d)
        status=0
        MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dump" timeout "${PTXAS_S:-150}" \
            python kernel_ncu.py --seq "${SEQ:-4096}" --mask "${MASK:-packed}" \
            --tile "${TILE:-aligned}" ${FWD_ONLY:+--fwd-only} "${sets[@]}" \
            > "$dump/call.log" 2>&1 || status=$?
        {
            echo "== $name ($fields): kernel_ncu.py exit $status"
            [ "$status" = 0 ] || tail -5 "$dump/call.log"
            for f in "$dump"/*.ptxas; do [ -e "$f" ] && { echo "-- $(basename "$f")"; cat "$f"; }; done
            if grep -qs C7513 "$dump"/*.ptxas; then echo "$name: SERIALIZED (C7513)"; fi
        } | tee -a "$OUT/ptxas_$run.txt"
        rm -rf "$dump"
    done
    ;;
*)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
