"""Issue 15: no import cycle among the modules of ``jax_seqpar.kernels``.

The static import graph of ``kernels/`` (every ``from jax_seqpar.kernels... import`` at
any depth, function-level ones included) must be acyclic: what two backends share lives
in a module both import (``pallas_common.py``), never in one of them.
"""

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "jax_seqpar" / "kernels"
MODULES = sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")


def _imports(path: pathlib.Path):
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("jax_seqpar.kernels."):
                out.add(node.module.rsplit(".", 1)[1])
            elif node.module == "jax_seqpar.kernels":
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.rsplit(".", 1)[1] for a in node.names
                       if a.name.startswith("jax_seqpar.kernels."))
    return out & set(MODULES)


def test_static_import_graph_is_acyclic():
    graph = {m: _imports(KERNELS / f"{m}.py") for m in MODULES}
    assert "pallas_common" in graph["pallas_gpu_bwd"] and "pallas_gpu" not in graph[
        "pallas_gpu_bwd"]
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = "done"

    for m in MODULES:
        visit(m, [])
