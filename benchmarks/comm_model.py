"""What-if table of communication time: a MODEL, not a measurement.

BurstEngine Table 1 (``jax_seqpar.parallel.comm_time.table1_time``) for RingAttention,
DoubleRing and BurstAttention on a multi-node cluster, next to ``strategy="double_ring"``
as implemented (``comm_time.double_ring_time``: the bytes it sends per axis, both axes
overlapped; Burst backward), USP (Ulysses inside a node x ring over nodes) and Ulysses,
whose time is the bytes ``costs.bytes_per_axis`` counts per mesh axis over that axis's
bandwidth plus one latency per collective (``comm_time.axis_time``).  Nothing runs on a
device.

    python benchmarks/comm_model.py                      # 8 nodes x 8 GPUs, 400 Gb/s NICs
    python benchmarks/comm_model.py --nodes 4 --nic-gbps 200 --seq 131072,1048576
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_seqpar.parallel.comm_time import (Link, axis_time, double_ring_time,  # noqa: E402
                                           table1_time)
from jax_seqpar.parallel.costs import AttnShape, bytes_per_axis  # noqa: E402


def rows(nodes, gpus, heads, head_dim, itemsize, seq, intra, inter):
    G = nodes * gpus
    T = seq // G
    P = T * heads * head_dim * itemsize  # B = 1: one device's block of one tensor
    out = [(m, table1_time(m, nodes=nodes, gpus_per_node=gpus, block_bytes=P,
                           intra=intra, inter=inter))
           for m in ("ring", "double_ring", "burst")]
    shape = AttnShape(1, seq, heads, heads, head_dim, itemsize)
    links = {"node": inter, "gpu": intra}
    # strategy="double_ring" as implemented: its bytes per axis, both axes overlapped
    out.append(("double_ring impl (q)", double_ring_time(
        shape, {"node": nodes, "gpu": gpus}, links, backward="q")))
    if heads % gpus == 0:  # USP: Ulysses over the GPUs of a node, ring ("q") over nodes
        b = bytes_per_axis("usp", shape, {"node": nodes, "gpu": gpus}, backward="q")
        tot = {a: b["forward"][a] + b["backward"][a] for a in links}
        # collectives in sequence: 8 all-to-alls in a node; 2 (nodes - 1) ring steps
        out.append(("usp (gpu x node)", axis_time(tot, {"gpu": 8, "node": 2 * (nodes - 1)},
                                                  links)))
    if heads % G == 0:  # Ulysses over all G GPUs: its all-to-alls run at the NIC's speed
        b = bytes_per_axis("ulysses", shape, {"all": G})
        out.append(("ulysses (all GPUs)", axis_time(
            {"all": b["forward"]["all"] + b["backward"]["all"]}, {"all": 8},
            {"all": inter})))
    else:
        out.append(("ulysses (all GPUs)", None))
    return P, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--itemsize", type=int, default=2, help="bytes per element (bf16: 2)")
    ap.add_argument("--seq", default="131072,1048576", help="comma-separated lengths")
    ap.add_argument("--nvlink-gbs", type=float, default=900.0,
                    help="intra-node GB/s per GPU (H100 NVLink 4: 900 aggregate)")
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="Gb/s per GPU's NIC")
    ap.add_argument("--lat-intra-us", type=float, default=5.0)
    ap.add_argument("--lat-inter-us", type=float, default=10.0)
    a = ap.parse_args(argv)
    intra = Link(a.nvlink_gbs * 1e9, a.lat_intra_us * 1e-6)
    inter = Link(a.nic_gbps / 8 * 1e9, a.lat_inter_us * 1e-6)
    print(f"MODEL (not a measurement): {a.nodes} nodes x {a.gpus} GPUs, NVLink "
          f"{a.nvlink_gbs:g} GB/s + {a.lat_intra_us:g} us, NIC {a.nic_gbps:g} Gb/s + "
          f"{a.lat_inter_us:g} us; MHA {a.heads} heads, D={a.head_dim}, "
          f"{a.itemsize} B/element, batch 1; forward + backward communication time")
    print(f"{'seq':>9} {'P (MB)':>8} {'method':<20} {'time (ms)':>10} {'vs ring':>8}")
    for seq in (int(s) for s in a.seq.split(",")):
        P, out = rows(a.nodes, a.gpus, a.heads, a.head_dim, a.itemsize, seq, intra, inter)
        ring = out[0][1]
        for name, t in out:
            cell = "n/a: heads" if t is None else f"{t * 1e3:10.1f}"
            rel = "" if t is None else f"{ring / t:7.2f}x"
            print(f"{seq:>9} {P / 1e6:8.1f} {name:<20} {cell:>10} {rel:>8}")


if __name__ == "__main__":
    main()
