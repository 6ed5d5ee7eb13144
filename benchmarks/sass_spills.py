"""Where ptxas spills in a Mosaic GPU kernel: per loop of its SASS, the instructions, the
matrix products (``HGMMA``) and the local-memory stores and loads (``STL`` / ``LDL``)
that ptxas's spill report adds up over the whole kernel.

Mosaic GPU compiles to PTX only on a GPU machine (its pipeline runs in the CUDA plugin),
but the PTX it dumps compiles anywhere ``ptxas`` runs; ``nvdisasm`` comes in the
``nvidia-cuda-nvdisasm`` wheel.  So:

    # on the GPU machine (the fused backward is entry_1 of a packed fwd+bwd call)
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR python benchmarks/kernel_ncu.py \\
        --seq 4096 --mask packed --tile aligned
    # anywhere with ptxas (CUDA 13) and nvdisasm
    python benchmarks/sass_spills.py DIR/entry_1.ptx --nvdisasm PATH/nvdisasm

A loop is a backward branch inside the function's body (up to its last unpredicated
``EXIT``: the barriers' retry stubs that ptxas places after it jump back into the body
and are left out); only innermost loops of ``--min-instrs`` or more are listed, which
leaves out short spin-waits.  ``.ptx.gz`` files are read too.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import tempfile

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`?\(?(\.L_x_\d+)")


def compile_sass(ptx_path: str, ptxas: str = "ptxas", nvdisasm: str = "nvdisasm",
                 arch: str = "sm_90a") -> tuple[str, str]:
    """``(sass, ptxas_report)`` of the PTX file (gzipped or not)."""
    opener = gzip.open if ptx_path.endswith(".gz") else open
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with opener(ptx_path, "rt") as src, open(ptx, "w") as dst:
            dst.write(src.read())
        cubin = os.path.join(tmp, "k.cubin")
        rep = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", cubin, ptx],
                             capture_output=True, text=True, check=True)
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    return sass, rep.stdout + rep.stderr


def loops(sass: str, min_instrs: int = 64) -> list[dict]:
    """The innermost loops of at least ``min_instrs`` instructions, in address order:
    ``{"start", "end", "instrs", "hgmma", "stl", "ldl"}`` (addresses as ints)."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _ADDR.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, m.group(2)))
    body_end = max((a for a, t in instrs if t.startswith("EXIT")), default=None)
    found = []
    for addr, text in instrs:
        if body_end is not None and addr > body_end:
            break
        m = _BRANCH.search(text)
        if m and labels.get(m.group(1), addr + 1) <= addr:
            body = [t for a, t in instrs if labels[m.group(1)] <= a <= addr]
            if len(body) >= min_instrs:
                found.append({"start": labels[m.group(1)], "end": addr, "instrs": len(body),
                              "hgmma": sum("HGMMA" in t for t in body),
                              "stl": sum(re.search(r"\bSTL\b", t) is not None for t in body),
                              "ldl": sum(re.search(r"\bLDL\b", t) is not None
                                         for t in body)})
    inner = [a for a in found
             if not any(b is not a and a["start"] <= b["start"] and b["end"] <= a["end"]
                        for b in found)]
    return sorted(inner, key=lambda x: x["start"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ptx", help="a PTX file Mosaic GPU dumped (.ptx or .ptx.gz)")
    p.add_argument("--ptxas", default="ptxas")
    p.add_argument("--nvdisasm", default="nvdisasm")
    p.add_argument("--min-instrs", type=int, default=64)
    args = p.parse_args(argv)
    sass, report = compile_sass(args.ptx, args.ptxas, args.nvdisasm)
    for line in report.splitlines():
        if "spill" in line or "registers" in line:
            print(line.strip())
    print(f"{'loop':>17s} {'instrs':>7s} {'HGMMA':>6s} {'STL':>4s} {'LDL':>4s}")
    for lp in loops(sass, args.min_instrs):
        print(f"{lp['start']:#07x}-{lp['end']:#07x} {lp['instrs']:7d} {lp['hgmma']:6d} "
              f"{lp['stl']:4d} {lp['ldl']:4d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
