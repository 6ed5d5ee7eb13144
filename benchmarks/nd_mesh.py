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


def main():
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
