#!/usr/bin/env bash
# Issue 40 on one GPU: the real model past its trained context (benchmarks/long_eval.py).
# The device tool carries at most 64 MiB per call, so the 98 MB GGUF travels in two parts
# (split -b 52000000 into .cache/real_models/part_aa, part_ab), each carried by one call on
# the same warm machine; the second call reassembles and checks it, then runs every variant
# in its own process (a variant that runs out of time leaves the others' results).
#   call 1 (carry .cache/real_models/part_aa):   true
#   call 2 (carry part_ab, .cache/corpus/kjv, .cache/corpus/jargon, .whl/gpu):
#       bash benchmarks/long_eval_gpu.sh
set -euo pipefail
OUT=${OUT:-benchmarks/out}
M=.cache/real_models
python -m pip install --quiet --no-deps --no-index --target /tmp/site .whl/gpu/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cat $M/part_aa $M/part_ab > $M/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LENGTHS=${LENGTHS:-4096,8192,16384,32768}
# a variant: a --rope-scaling value, optionally @THETA for --rope-theta (a larger base)
RES=/tmp/long_eval
for v in ${VARIANTS:-model yarn:4 dynamic:4 linear:4 none@4e5}; do
  scaling=${v%@*}; theta=model; [[ $v == *@* ]] && theta=${v#*@}
  name=${v//[:@]/_}
  timeout ${PER_VARIANT_S:-130} python benchmarks/long_eval.py --preset gpu --corpus .cache/corpus \
    --lengths "$LENGTHS" --rope-scaling "$scaling" --rope-theta "$theta" \
    --ppl-samples ${PPL:-4} --passkey-samples ${PASSKEY:-2} --out "$RES/$name" \
    || echo "variant $v: exit $?"
done
# one archive: the device tool brings back a limited number of files
tar czf "$OUT/long_eval.tgz" -C "$RES" .
