"""Merge the ``check`` rows of several ``benchmarks/kernels.py`` result files into one.

A check run split over several device calls (``--dims``, ``--dtypes``, ``--cases``) leaves
one JSON file per call.  This keeps, for every (case, head dim, dtype, kernel), the row of
the **last** file that has it (list the files oldest first), notes which file it came
from, and prints how many cases passed per kernel.

    python benchmarks/merge_checks.py OUT.json FILE1.json FILE2.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def merge(paths):
    rows, envs = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        name = os.path.basename(path)
        envs[name] = data.get("env")
        for row in data.get("check", []):
            key = (row["case"], row["D"], row["dtype"], row["kernel"])
            rows[key] = {**row, "source": name}
    return [rows[k] for k in sorted(rows)], envs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    rows, envs = merge(a.files)
    kernels = sorted({r["kernel"] for r in rows})
    summary = {}
    for k in kernels:
        mine = [r for r in rows if r["kernel"] == k]
        ok = [r for r in mine if r["ok"]]
        worst = {dt: max((max(r["out"], r["dq"], r["dk"], r["dv"]) for r in ok
                          if r["dtype"] == dt), default=None)
                 for dt in sorted({r["dtype"] for r in ok})}
        summary[k] = dict(cases=len(mine), passed=len(ok), worst_rel_error=worst)
        print(f"{k}: {len(ok)} of {len(mine)} passed; worst relative error per dtype: "
              + ", ".join(f"{dt} {w:.1e}" for dt, w in worst.items()))
        for r in mine:
            if not r["ok"]:
                print(f"  FAIL {r['case']} D={r['D']} {r['dtype']} ({r['source']}): "
                      f"{r.get('error', '')}")
    with open(a.out, "w") as f:
        json.dump({"sources": envs, "summary": summary, "check": rows}, f, indent=1)
    return 0 if all(s["passed"] == s["cases"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
