"""How many memory maps each compiled CPU program keeps, on the JAX installed here.

XLA's CPU backend keeps a compiled program's machine code in memory maps of its own, and
JAX's caches keep the programs alive, so a process that compiles many programs (a test
worker running half of the suite) holds more and more maps.  Past Linux's
``vm.max_map_count`` (65,530 by default) the next mmap fails and XLA's compiler crashes
with a segmentation fault.  ``tests/conftest.py`` drops JAX's caches in a worker that is
past half the limit; this script measures the rate that makes that necessary.

    python scripts/cpu_program_maps.py [--programs 300]

It compiles ``--programs`` distinct small programs (an 8-device ``shard_map`` of a
causal softmax attention each, shapes varied so that none is a cache hit), counts
``/proc/self/maps`` before and after, then calls ``jax.clear_caches()`` and counts again.

The crash itself, on purpose (as root; put the limit back after):

    sysctl -w vm.max_map_count=6000; python scripts/cpu_program_maps.py --programs 300
    sysctl -w vm.max_map_count=65530

prints "LLVM compilation error: Cannot allocate memory" and dies of SIGSEGV in
``backend_compile_and_load`` (JAX 0.11.2, 2026-11-26), the stack of the suite's crashes.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402


def map_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=300)
    a = p.parse_args(argv)
    if a.programs < 1:
        p.error(f"--programs must be at least 1, got {a.programs}")
    if not os.path.exists("/proc/self/maps"):
        print("no /proc/self/maps here (not Linux): nothing to count", file=sys.stderr)
        return 1
    mesh = Mesh(jax.devices()[:8], ("x",))

    def program(n):
        def local(x):  # causal softmax attention of x with itself, then a psum
            s = x @ x.T / 4.0
            s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)
            y = jax.nn.softmax(s, axis=-1) @ x
            return jax.lax.psum(jnp.tanh(y).sum(axis=0, keepdims=True), "x") + y
        f = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(f), jnp.ones((8 * n, 16), jnp.float32) / n

    warm, x = program(1)
    warm(x).block_until_ready()
    before = map_count()
    for i in range(a.programs):
        f, x = program(i + 2)
        f(x).block_until_ready()
    after = map_count()
    jax.clear_caches()
    cleared = map_count()
    limit = open("/proc/sys/vm/max_map_count").read().strip()
    per = (after - before) / a.programs
    print(f"JAX {jax.__version__}, Python {sys.version.split()[0]}: {a.programs} programs "
          f"added {after - before} maps ({per:.1f} per program); after "
          f"jax.clear_caches(): {cleared} maps (from {after}); vm.max_map_count {limit}, "
          f"reached after about {int(limit) / per:,.0f} such programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
