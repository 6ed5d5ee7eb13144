"""Build the notebooks from their sources in ``notebooks/_src/`` and execute them.

Each source is a plain Python file in the "percent" format: ``# %%`` starts a code cell and
``# %% [markdown]`` a markdown cell whose lines are comments (``# `` is stripped).  The sources
run as ordinary scripts too (``python notebooks/_src/energy_function.py``), which is the quickest
way to debug a failing check.

    python notebooks/_build.py                    # build and execute both, save with outputs
    python notebooks/_build.py ring_and_burst     # just one
    python notebooks/_build.py --no-execute       # save without outputs

The notebooks are committed with their outputs so that they read well when browsed;
``tests/test_notebooks.py`` executes them and checks that they match their sources.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List

import nbformat
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parent
SRC_DIR = NB_DIR / "_src"
NAMES = ("energy_function", "ring_and_burst")
KERNEL_NAME = "jax-seqpar-python"
#: What readers' Jupyter should start: the standard kernel name, not the build's private one.
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def parse_cells(text: str) -> List[tuple]:
    """Split percent-format source into ``[(kind, source)]`` with kind "code" or "markdown"."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(lines).strip("\n")
            if body:
                cells.append((kind, body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
            continue
        if kind == "markdown":
            if line.strip() and not line.startswith("#"):
                raise ValueError(f"markdown line does not start with '#': {line!r}")
            line = line[2:] if line.startswith("# ") else line[1:]
        lines.append(line)
    flush()
    return cells


def build(name: str) -> nbformat.NotebookNode:
    """The notebook for ``_src/<name>.py``, without outputs."""
    nb = nbformat.v4.new_notebook()
    for i, (kind, body) in enumerate(parse_cells((SRC_DIR / f"{name}.py").read_text())):
        cell = (nbformat.v4.new_markdown_cell(body) if kind == "markdown"
                else nbformat.v4.new_code_cell(body))
        cell.id = f"{name}-{i:02d}"  # stable ids keep diffs small
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


@contextlib.contextmanager
def current_python_kernel() -> Iterator[str]:
    """A Jupyter kernel that runs *this* interpreter, whatever kernels the user has installed.

    A kernelspec named ``python3`` may point at another Python (``ipykernel install --user`` from
    a different environment), so a private spec is written to a temporary directory that goes
    first on ``JUPYTER_PATH`` for the duration.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "kernels" / KERNEL_NAME
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python (jax_seqpar notebooks)", "language": "python"}))
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = tmp if old is None else tmp + os.pathsep + old
        try:
            yield KERNEL_NAME
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> float:
    """Run every cell in a fresh kernel (working directory: ``notebooks/``); returns seconds.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell.
    """
    with current_python_kernel() as kernel:
        client = NotebookClient(nb, timeout=timeout, kernel_name=kernel, record_timing=False,
                                resources={"metadata": {"path": str(NB_DIR)}})
        start = time.perf_counter()
        client.execute()
        elapsed = time.perf_counter() - start
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(NAMES)} (default: all)")
    parser.add_argument("--no-execute", action="store_true")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(NAMES)
    if unknown:
        parser.error(f"unknown notebook(s) {sorted(unknown)}; choose from {NAMES}")
    for name in args.names or NAMES:
        nb = build(name)
        if not args.no_execute:
            seconds = execute(nb, args.timeout)
            print(f"{name}: executed in {seconds:.1f} s")
        path = NB_DIR / f"{name}.ipynb"
        nbformat.write(nb, str(path))
        print(f"{name}: wrote {path.relative_to(NB_DIR.parent)} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
