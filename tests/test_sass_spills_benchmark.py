"""benchmarks/sass_spills.py's SASS reading on a hand-written listing (compiling needs
ptxas and nvdisasm, which CI does not have)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sass_spills  # noqa: E402


def _listing(body):
    return "\n".join(f"        /*{a:04x}*/                   {t} ;" if a is not None
                     else t for a, t in body)


def test_loops_are_the_innermost_backward_branches_of_the_body():
    """Two step loops (one with a spill store and two reloads) and a short spin-wait
    inside a larger loop; a retry stub after the last EXIT that jumps back into the body
    is not a loop, nor is the outer loop that holds the others."""
    body = [(None, ".L_x_0:"), (0x10, "MOV R1, R2")]
    body += [(None, ".L_x_1:"), (0x20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"),
             (0x30, "STL [R1+0x4], R5"), (0x40, "LDL R6, [R1+0x4]"),
             (0x50, "LDL.LU R7, [R1+0x8]"), (0x60, "IADD3 R0, R0, 1"),
             (0x70, "@P0 BRA `(.L_x_1)")]
    body += [(None, ".L_x_2:"), (0x80, "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR12], R20"),
             (0x90, "@!P2 BRA `(.L_x_2)")]
    body += [(None, ".L_x_3:")] + [(0xa0 + 0x10 * i, "FFMA R1, R2, R3, R4")
                                   for i in range(5)]
    body += [(0xf0, "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88"),
             (0x100, "@P1 BRA `(.L_x_3)"), (0x110, "@P3 BRA `(.L_x_0)"), (0x120, "EXIT"),
             (0x130, "BRA `(.L_x_1)")]
    got = sass_spills.loops(_listing(body), min_instrs=4)
    assert [(x["start"], x["end"]) for x in got] == [(0x20, 0x70), (0xa0, 0x100)]
    assert got[0] == {"start": 0x20, "end": 0x70, "instrs": 6, "hgmma": 1, "stl": 1,
                      "ldl": 2}
    assert got[1]["instrs"] == 7 and got[1]["hgmma"] == 1 and got[1]["stl"] == 0
