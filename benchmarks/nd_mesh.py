"""N-D meshes (issue 38): what ``sharding.choose_mesh`` picks for three H200 clusters, and
the bytes behind the residual stream's layout on the tensor axis.

1. ``choose_mesh`` (a model, not a measurement) for the README's three clusters: 141 GB
   and 989 TFLOP/s per H200, NVLink 450 GB/s, InfiniBand 50 GB/s per GPU, bf16
   activations, float32 parameters.
2. On 8 simulated CPU devices: the tensor-axis bytes per block of a compiled forward,
   one block of ``models.Llama`` (d 64, float32, 4 x 32 tokens) on tensor 2, with the
   residual stream whole on the tensor axis (the library's rule: one all-reduce per block
   side) and split over sequence x tensor rows (Megatron's reduce-scatter form, via a
   ``Parallelism`` whose ``residual`` rule adds the tensor axes).  Per block = 2 blocks
   minus 1.

    python benchmarks/nd_mesh.py

3. ``--report DIR [DIR ...]`` (issue 42): the rows that ``nd_mesh_gpu.sh`` measured
   (``train_mfu*.json`` and ``generate*.json`` under the folders), one table per
   (size, length): step time, MFU, peak memory, the measured rank, and what
   ``choose_mesh`` models for each mesh now (``train_mfu.mesh_choice``: the row's
   shapes, remat mode and layer form) beside what it modeled in the run (the row's
   ``choose_mesh`` field); then the generation rows (decode ms per token against the
   HBM floor, per mesh).  Prints markdown; writes ``nd_mesh_report.json``.

    python benchmarks/nd_mesh.py --report benchmarks/results/nd_mesh_gpu/2026-11-26
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.parallel.comm_time import Link  # noqa: E402
from jax_seqpar.runtime.comm import collective_bytes  # noqa: E402
from jax_seqpar.sharding import Parallelism, choose_mesh, make_mesh  # noqa: E402
from _util import env_info, out_dir, save_json  # noqa: E402

H200 = dict(device_memory=141e9, device_flops=989e12, intra_link=Link(450e9, 5e-6))
IB = Link(50e9, 10e-6)
B7 = LlamaConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 ffn_dim=11008, dtype="bfloat16")
B70 = LlamaConfig(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64,
                  num_kv_heads=8, ffn_dim=28672, dtype="bfloat16")
CLUSTERS = [("7B, 1 node x 8, one 128k sequence", B7, dict(seq_len=131072, global_batch=1,
                                                           devices_per_node=8, nodes=1)),
            ("7B, 8 nodes x 8, 8 x 128k", B7, dict(seq_len=131072, global_batch=8,
                                                   devices_per_node=8, nodes=8)),
            ("70B, 8 nodes x 8, 64 x 32k", B70, dict(seq_len=32768, global_batch=64,
                                                     devices_per_node=8, nodes=8))]


class SequenceParallelResidual(Parallelism):
    """The residual stream's rows over sequence x tensor (Megatron's reduce-scatter form)."""

    def rules(self):
        return tuple((n, self.sequence_axes + self.tensor_axes) if n == "residual" else (n, a)
                     for n, a in super().rules())


def tensor_bytes(par_cls, layers):
    cfg = LlamaConfig(vocab_size=128, d_model=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, ffn_dim=128)
    mesh, par = make_mesh(dict(sequence=1, tensor=2), jax.devices()[:2])
    par = par_cls(**{k: getattr(par, k) for k in ("data", "fsdp", "sequence", "tensor")})
    model = Llama(cfg, mesh=mesh, parallelism=par)
    tokens = jnp.zeros((4, 32), jnp.int32)
    params = jax.device_put(model.init(jax.random.key(0), tokens),
                            model.param_shardings(jax.random.key(0), tokens))
    rep = collective_bytes(jax.jit(lambda p, t: model.apply(p, t, return_hidden=True)),
                           params, tokens)
    return rep.bytes_by_axis(mesh).get("tensor", 0), rep.bytes_by_kind()


def _label(sizes) -> str:
    if sizes is None:
        return "no mesh (none fits)"
    if not isinstance(sizes, dict):
        return str(sizes)
    return " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "1 device"


def _gpu_memory(data) -> float:
    """The bytes a GPU of the run ``data`` could hold, as its rows' model saw them: recorded
    by runs since 2026-11-26 (``choose_mesh.memory``); before, an H100 80GB's 81,559 MiB
    times the run's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else an H200's 141 GB."""
    from train_mfu import H200_MEMORY
    for r in data.get("rows", []):
        if (r.get("choose_mesh") or {}).get("memory"):
            return r["choose_mesh"]["memory"]
    if "H100" in data["env"].get("device_kind", ""):
        return 81559 * 2 ** 20 * float(data.get("mem_fraction") or 0.75)
    return H200_MEMORY


def _modeled(r, sizes, rows, scan, memory) -> dict:
    """``choose_mesh``'s numbers for row ``r``'s mesh on GPUs of ``memory`` bytes; where no
    mesh fits, the numbers without a memory bound and ``pick`` None."""
    from train_mfu import mesh_choice, predicted_for
    args = (r["size"], r["G"], r["S"], r["remat"])
    try:
        return predicted_for(mesh_choice(*args, rows=rows, scan_layers=scan, memory=memory),
                             sizes)
    except ValueError:
        now = predicted_for(mesh_choice(*args, rows=rows, scan_layers=scan,
                                        memory=float("inf")), sizes)
        return dict(now, pick=None, picked=False,
                    skipped=f"no mesh fits {memory / 1e9:.0f} GB")


def report(dirs):
    """The measured rows of ``dirs`` against ``choose_mesh`` (module docstring, 3)."""
    import glob
    import json

    from jax_seqpar.sharding import parse_mesh_arg
    groups, gen = {}, []
    for d in dirs:
        for f in sorted(glob.glob(os.path.join(d, "**", "*.json"), recursive=True)):
            data = json.load(open(f))
            if os.path.basename(f).startswith("generate"):
                gen.extend(data["rows"])
                continue
            for r in data.get("rows", []):
                sizes = r["mesh"] if isinstance(r["mesh"], dict) else parse_mesh_arg(r["mesh"])
                rows = r.get("batch_rows") or (data["config"].get("batch") or 1)
                scan = bool(data["config"].get("scan_layers"))
                memory = _gpu_memory(data)
                now = _modeled(r, sizes, rows, scan, memory)
                key = (data["env"].get("device_kind", "?"), memory, r["size"], r["S"],
                       r["remat"], rows)
                groups.setdefault(key, []).append(
                    dict(row=r, sizes=sizes, now=now, then=r.get("choose_mesh")))
    out = []
    for (kind, memory, size, S, remat, rows), items in groups.items():
        ran = sorted((i for i in items if "error" not in i["row"]),
                     key=lambda i: i["row"]["step_s"])
        best = ran[0]["row"]["step_s"] if ran else None
        print(f"\n**{size}, {rows} x {S // 1024}k tokens per step, remat {remat}, "
              f"{items[0]['row']['G']} x {kind} ({memory / 1e9:.0f} GB each)** "
              f"(choose_mesh now picks {_label(items[0]['now']['pick'])})\n")
        print("| mesh | step (s) | vs best | MFU | peak (GiB) | model step (s) | "
              "model memory (GiB) | in the run: model GiB, pick |")
        print("|:--|--:|--:|--:|--:|--:|--:|:--|")
        for i in sorted(items, key=lambda i: i["row"].get("step_s", float("inf"))):
            r, now, then = i["row"], i["now"], i["then"] or {}
            pick = "**pick**" if now["picked"] else ""
            fits = f" ({now['skipped']})" if now["skipped"] else ""
            ran_cols = ("| out of memory | | | " if "error" in r else
                        f"| {r['step_s']:.3f} | {r['step_s'] / best:.3f} | "
                        f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} ")
            then_cols = (f"{then['memory_gib']:.1f}, {_label(then['pick'])}"
                         if then.get("memory_gib") is not None else "")
            print(f"| {_label(i['sizes'])} {pick} {ran_cols}| {now['step_s']:.3g} | "
                  f"{now['memory_gib']:.1f}{fits} | {then_cols} |")
            out.append(dict(device_kind=kind, device_memory=memory, G=r["G"], size=size,
                            S=S, remat=remat, rows=rows, mesh=i["sizes"],
                            measured=None if "error" in r else dict(
                                step_s=r["step_s"], mfu=r["mfu"], peak_gib=r["peak_gib"]),
                            error=r.get("error"), model_now=now, model_in_run=then))
    if gen:
        print("\n| model, prompt, batch | mesh | weights per GPU (GB) | prefill tokens/s | "
              "decode ms/token | HBM floor ms | of floor |")
        print("|:--|:--|--:|--:|--:|--:|--:|")
        for r in gen:
            if "error" in r:
                print(f"| {r['size']}:{r['prompt']}:{r['batch']} | {r.get('mesh_arg')} | "
                      f"{r['error'][:60]} | | | | |")
                continue
            print(f"| {r['size']}, {r['prompt'] // 1024}k, {r['batch']} | "
                  f"{r.get('mesh_arg', _label(r['mesh']))} | "
                  f"{r['weight_bytes_per_device'] / 1e9:.2f} | "
                  f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_ms_per_token']:.2f} | "
                  f"{r['floor_ms_per_token']:.2f} | {r['fraction_of_floor']:.2f} |")
    save_json(dict(env=env_info(), dirs=list(dirs), train=out, generate=gen),
              os.path.join(out_dir(), "nd_mesh_report.json"))


def main():
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", default=None, metavar="DIR",
                   help="measured rows (nd_mesh_gpu.sh) against choose_mesh")
    a = p.parse_args()
    if a.report:
        return report(a.report)
    rows = []
    print(f"# {env_info()}")
    for name, cfg, kw in CLUSTERS:
        c = choose_mesh(cfg, inter_link=IB if kw["nodes"] > 1 else None, **H200, **kw)
        row = dict(cluster=name, pick=c.sizes, step_s=c.pick.step_seconds,
                   bytes_gb={k: v / 1e9 for k, v in c.pick.bytes.items()},
                   memory_gb=c.pick.memory / 1e9, reason=c.reason)
        rows.append(row)
        print(f"{name:36s} {c.sizes}  {c.pick.step_seconds:6.2f} s  "
              f"{c.pick.memory / 1e9:6.1f} GB/device")
    activation = 4 * 32 * 64 * 4
    residual = {}
    for label, cls in (("whole on tensor (all-reduce)", Parallelism),
                       ("sequence x tensor rows (reduce-scatter form)",
                        SequenceParallelResidual)):
        (one, k1), (two, k2) = tensor_bytes(cls, 1), tensor_bytes(cls, 2)
        residual[label] = dict(per_block=two - one, per_block_in_activations=(two - one) /
                               activation, kinds_two_blocks=k2)
        print(f"tensor-axis bytes per block, residual {label}: {two - one} "
              f"({(two - one) / activation:.2f} x the block's activation)")
    save_json(dict(env=env_info(), clusters=rows, residual=residual),
              os.path.join(out_dir(), "nd_mesh.json"))


if __name__ == "__main__":
    main()
