"""``examples/finetune_long_context.py`` on CPU at tiny sizes: two stages, stopped after
step 5 (a stand-in for a preemption), rerun with the same command to resume from the
checkpoint of step 4 -- the recomputed step 5 has the first run's loss bit for bit (same
parameters, optimizer state and data position) -- and the export loads with
``models.hf.load_pretrained`` into a model that predicts the corpus better than a
random one."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import AxisType

from jax_seqpar.data import make_iterator
from jax_seqpar.models import Llama, next_token_loss
from jax_seqpar.models.hf import load_pretrained

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "examples", "finetune_long_context.py")


def run(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))  # rerun: no compile
    cmd = [sys.executable, SCRIPT, "--out", str(tmp_path / "out"), "--devices", "2",
           "--stages", "64,128", "--steps", "3", "--rope-theta", "1e4,4e4", "--batch", "2",
           "--d-model", "32", "--layers", "1", "--bpe-vocab", "300", "--save-every", "2",
           "--keep", "2", "--export", str(tmp_path / "export"), *extra]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    with open(tmp_path / "out" / "finetune_log.json") as f:
        return json.load(f), out.stdout


def test_finetune_stops_resumes_exactly_and_exports(tmp_path):
    first, _ = run(tmp_path, "--stop-after", "5")
    assert first["steps_done"] == 5 and [r["step"] for r in first["log"]] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "export").exists()  # no export before the last step
    ckpts = sorted(int(p) for p in os.listdir(tmp_path / "out" / "ckpt") if p.isdigit())
    assert ckpts == [2, 4]                     # save every 2, keep 2; step 5 not saved

    second, stdout = run(tmp_path)
    assert "resumed from" in stdout and "at step 4" in stdout
    log = second["log"]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert [r["stage"] for r in log] == [1, 1, 1, 2, 2, 2]
    assert log[:4] == first["log"][:4]         # kept from the first run
    assert log[4]["loss"] == first["log"][4]["loss"]  # step 5 recomputed: bit-identical
    assert log[-1]["loss"] < log[0]["loss"]
    assert set(second["packing"]) == {"1", "2"}  # stage 1 kept from the first run

    # The export: transformers' layout, the last stage's RoPE base and length, trained.
    cfg, params = load_pretrained(tmp_path / "export", dtype="float32")
    assert cfg.rope_theta == 4e4 and cfg.max_position_embeddings == 128
    assert cfg.vocab_size == 300 and cfg.num_layers == 1 and cfg.d_model == 32
    assert (tmp_path / "export" / "tokenizer.json").exists()
    it = make_iterator(tmp_path / "out" / "corpus", seq_len=128, batch_size=2, seed=7,
                       tokenizer=tmp_path / "export")
    batch = next(it)
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1],
                         axis_types=(AxisType.Auto,))
    model = Llama(cfg, mesh=mesh)
    random = jax.jit(model.init)(jax.random.key(1), batch["tokens"])

    @jax.jit  # one program for both parameter sets, not one per operation
    def jitted_loss(p):
        return next_token_loss(model, p, batch["tokens"], loss_mask=batch["loss_mask"],
                               segment_ids=batch["segment_ids"],
                               positions=batch["positions"])[0]

    def loss(p):
        return float(jitted_loss(p))
    trained, untrained = loss(params), loss(random)
    assert np.isfinite(trained) and trained < untrained - 0.3, (trained, untrained)
