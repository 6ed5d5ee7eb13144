#!/usr/bin/env bash
# Issue 40, step 6 on one GPU: SmolLM2-135M fine-tuned from 8k to 32k tokens on real text
# and passkey conversations, then evaluated by long_eval.py beside the base model.
# The device tool carries at most 64 MiB per call, so the run takes three calls on one
# warm machine (it keeps .cache/, .whl/ and /tmp between calls; make them one after
# another, within its idle time):
#   call 1 (carry .whl/gpu, .cache/real_models/part_ab):       bash benchmarks/long_finetune_gpu.sh probe
#   call 2 (carry .cache/real_models/part_aa, .cache/corpus_text.tar.xz):
#                                                               bash benchmarks/long_finetune_gpu.sh train
#   call 3 (no carry):                                          bash benchmarks/long_finetune_gpu.sh eval
# part_aa / part_ab: `split -b 52000000` of the GGUF (scripts/fetch_real_model.py);
# corpus_text.tar.xz: `tar cJf .cache/corpus_text.tar.xz -C .cache/corpus kjv jargon
# python-docs MANIFEST.json` (scripts/fetch_corpus.py); .whl/gpu: wheels the GPU machine
# lacks (it has no network): gguf, jinja2, markupsafe, grain, array-record, cloudpickle,
# portpicker (`pip download --no-deps` for CPython 3.12, manylinux).
# `probe` times a few steps of a random model of the same shape (byte vocabulary) at
# 32k, and `train` sizes its run from that speed (STEP_BUDGET_S seconds of steps, or
# STEPS); `train` is resumable (examples/finetune_long_context.py resumes from its newest
# checkpoint), so `eval` first finishes a fine-tuning that ran out of time in call 2.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
M=.cache/real_models
GGUF=$M/SmolLM2-135M-Instruct.Q4_1.gguf
FT=${FT:-.cache/ft}           # the run's checkpoints, log and export
DATA=${DATA:-$FT/data}        # its training data (long_finetune_data.py)
[ -d /tmp/site/grain ] ||   # else installed by an earlier call
  python -m pip install --quiet --no-deps --no-index --target /tmp/site .whl/gpu/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
REMAT=${REMAT:-attention_mlp}
# the number of steps: STEPS, else what STEP_BUDGET_S seconds hold at the probe's speed
# (x 0.75 for the real model's 49152-token LM head), between 60 and 400
if [ -z "${STEPS:-}" ] && [ -f /tmp/probe/finetune_log.json ]; then
  STEPS=$(python -c "
import json, statistics
rows = [r for r in json.load(open('/tmp/probe/finetune_log.json'))['log'] if not r['compile']]
tps = 0.75 * statistics.median(r['tokens_per_s'] for r in rows)
print(max(60, min(400, int(${STEP_BUDGET_S:-360} * tps / 32768))))")
  echo "steps from the probe's speed: $STEPS"
fi
STEPS=${STEPS:-200}
# fine-tuning: one stage at 32k with YaRN x4 (the best training-free variant at 32k)
FINETUNE=(python examples/finetune_long_context.py --checkpoint $GGUF --data $DATA
  --stages 32768 --steps $STEPS --batch 1 --rope-scaling yarn:4 --lr ${LR:-1e-4}
  --warmup 12 --remat $REMAT --scan-layers --save-every 20 --keep 2
  --log-every 10 --out $FT/run --ckpt-dir $FT/ckpt --export $FT/export
  --export-dtype float32)

case ${1:?probe, train or eval} in
probe)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python examples/finetune_long_context.py --d-model 576 --layers 30 --heads 9 \
    --kv-heads 3 --tokenizer bytes --stages 32768 --steps 6 --batch 1 --remat $REMAT \
    --scan-layers --save-every 1000 --keep 1 --out /tmp/probe --no-compile-cache
  cp /tmp/probe/finetune_log.json "$OUT/probe_log.json"
  ;;
train)
  cat $M/part_aa $M/part_ab > $GGUF
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
  # the evaluation corpus as long_eval.py read it for the training-free run (kjv, jargon);
  # the Python documentation is training text only
  mkdir -p .cache/corpus .cache/corpus-extra
  tar xJf .cache/corpus_text.tar.xz -C .cache/corpus kjv jargon MANIFEST.json
  tar xJf .cache/corpus_text.tar.xz -C .cache/corpus-extra python-docs
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  [ -f $DATA/MANIFEST.json ] || python benchmarks/long_finetune_data.py --model $GGUF \
    --corpus .cache/corpus --extra .cache/corpus-extra/python-docs --out $DATA \
    --passkey-spread ${SPREAD:-log}
  timeout -s INT ${TRAIN_S:-470} "${FINETUNE[@]}" \
    || echo "fine-tuning stopped (exit $?): call eval to resume and finish it"
  cp $FT/run/finetune_log.json $DATA/MANIFEST.json "$OUT/" 2>/dev/null || true
  ;;
eval)
  [ -f $FT/export/config.json ] || "${FINETUNE[@]}"
  RES=/tmp/long_finetune
  args="--corpus .cache/corpus --lengths ${LENGTHS:-4096,8192,16384,32768}
        --ppl-samples ${PPL:-4} --passkey-samples ${PASSKEY:-4}"
  # after: the fine-tuned model as exported (its config holds YaRN x4)
  timeout ${PER_VARIANT_S:-200} python benchmarks/long_eval.py --model $FT/export \
    --rope-scaling model $args --out $RES/finetuned || echo "fine-tuned eval: exit $?"
  # before, in the same run: the base model with the best training-free scaling
  timeout ${PER_VARIANT_S:-200} python benchmarks/long_eval.py --model $GGUF \
    --rope-scaling yarn:4 $args --out $RES/base_yarn_4 || echo "base eval: exit $?"
  cp $FT/run/finetune_log.json $FT/run/loss.png $DATA/MANIFEST.json $RES/ 2>/dev/null || true
  tar czf "$OUT/long_finetune.tgz" -C "$RES" .
  ;;
esac
