#!/usr/bin/env bash
# Bring flash-attn-jax 0.6.2 to a GPU machine without network, for benchmarks/kernels.py.
#
# Its wheel (77 MB, a 188 MB extension inside) is too big to carry as is; the extension
# compresses with xz to about 30 MB.  It links against libcudart.so.12 (wheel
# nvidia-cuda-runtime-cu12).  Its metadata pins jax<0.9, so it is installed without deps.
#
#   bash benchmarks/carry_flash_attn.sh pack           # here (needs pip access): fills .carry/
#   source benchmarks/carry_flash_attn.sh unpack       # there: /tmp/fa on PYTHONPATH, LD path
#
# .carry/ is listed in .git/info/exclude by "pack" (it must not be committed); name it in
# the device call's carry list.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/.carry/flash_attn"

pack() {
    local tmp
    tmp="$(mktemp -d)"
    local exclude
    exclude="$(git -C "$root" rev-parse --git-path info/exclude)"
    [[ "$exclude" = /* ]] || exclude="$root/$exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >> "$exclude"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$tmp" \
        flash-attn-jax==0.6.2 nvidia-cuda-runtime-cu12==12.9.79
    rm -rf "$dir" && mkdir -p "$dir/site" "$dir/lib"
    (cd "$dir/site" && unzip -q "$tmp"/flash_attn_jax-*.whl)
    (cd "$tmp" && unzip -q nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/*')
    cp "$tmp"/nvidia/cuda_runtime/lib/libcudart.so.12 "$dir/lib/"
    xz -9 -T2 "$dir"/site/flash_attn_jax_lib/*.so "$dir/lib/libcudart.so.12"
    rm -rf "$tmp"
    du -sh "$dir"
}

unpack() {
    rm -rf /tmp/fa && cp -r "$dir" /tmp/fa
    find /tmp/fa -name '*.xz' -exec xz -d {} +
    export PYTHONPATH="/tmp/fa/site${PYTHONPATH:+:$PYTHONPATH}"
    export LD_LIBRARY_PATH="/tmp/fa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

case "${1:-}" in
    pack) pack ;;
    unpack) unpack ;;
    *) echo "usage: $0 pack|unpack" >&2; exit 2 ;;
esac
