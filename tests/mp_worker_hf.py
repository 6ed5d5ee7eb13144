"""Worker of tests/test_hf.py: load a checkpoint onto a mesh over the devices of every
process and save it back (each tensor gathered from both processes; process 0 writes).

    python -m jax_seqpar launch -n 2 --devices-per-process 4 -- \\
        python tests/mp_worker_hf.py SRC DST
"""

from __future__ import annotations

import sys


def main(src: str, dst: str) -> int:
    import jax_seqpar.runtime.distributed as jd

    info = jd.initialize()
    import jax
    from jax.sharding import AxisType

    from jax_seqpar.models.hf import load_pretrained, save_pretrained

    mesh = jax.make_mesh((jax.device_count(),), ("sp",), axis_types=(AxisType.Auto,))
    cfg, params = load_pretrained(src, mesh=mesh, dtype="float32")
    emb = params["params"]["embed"]["embedding"]
    assert not emb.is_fully_addressable and len(emb.addressable_shards) == 4
    assert all(s.data.shape[0] * 8 == emb.shape[0] for s in emb.addressable_shards)
    save_pretrained(cfg, params, dst, max_shard_size="200KB")
    print(f"process {info.process_index} of {info.process_count} saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
