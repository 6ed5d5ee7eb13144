"""Issue 25, item 4: every Python block of README.md runs as written.

Each ```python block is run on its own, in a fresh interpreter, as a user who copies that
one block would run it: 8 simulated CPU devices (the flags of ``tests/conftest.py``,
inherited through the environment), ``JAX_PLATFORMS=cpu``, the working directory an empty
temporary folder (blocks that write files leave nothing behind), and this checkout first
on ``PYTHONPATH``.  A fresh process per block means no block can lean on names, devices
or JAX state that an earlier one left, and none can touch the pytest process.

A block may choose smaller sizes on CPU, stating them itself (e.g. ``S = 8192 if
jax.default_backend() == "gpu" else 1024``); the test runs the block exactly as printed.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMEOUT_S = 300  # per block; each takes seconds (the test's --durations report the times)

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(section heading, source)`` of every ```python block of a Markdown text, in order.

    Fences are tracked so that ``#`` lines inside a block (bash comments, SLURM's
    ``#SBATCH``) are never taken for headings; indented blocks (in a list) are dedented.
    """
    blocks, heading, fence, lang, body = [], "", None, "", []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, lang, body = m.group(1), m.group(2).lower(), []
            elif re.match(r"#{1,6}\s", line):
                heading = line.lstrip("#").strip()
        elif m and m.group(1).startswith(fence) and not line.strip().strip(fence[0]):
            if lang in ("python", "py", "python3"):
                blocks.append((heading, textwrap.dedent("\n".join(body)) + "\n"))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        raise ValueError("unclosed ``` fence")
    return blocks


def _block_id(index: int, heading: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-") or "top"
    return f"{index}-{slug}"


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks():
    """Without blocks the parametrised test below would pass by running nothing."""
    assert len(BLOCKS) >= 1, f"no ```python blocks found in {README}"


def test_block_extraction():
    text = textwrap.dedent("""\
        # Title
        ```bash
        # not a heading
        make test
        ```
        ## Usage
        ```python
        x = 1
        ```
        - a list item:
          ```py
          if x:
              y = 2
          ```
        ```
        # plain block: not Python
        ```
        ### Later
        ````python
        s = "```"
        ````
        """)
    assert python_blocks(text) == [("Usage", "x = 1\n"), ("Usage", "if x:\n    y = 2\n"),
                                   ("Later", 's = "```"\n')]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # tests/conftest.py has already put its flags (8 devices, fast CPU compilation) into
    # os.environ["XLA_FLAGS"]; force the device count even if the caller's flags had none
    flags = env.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONSTARTUP", None)
    return env


@pytest.mark.parametrize("heading,source", BLOCKS,
                         ids=[_block_id(i, h) for i, (h, _) in enumerate(BLOCKS, 1)])
def test_readme_block_runs(heading, source, tmp_path, record_property):
    script = tmp_path / "block.py"
    script.write_text(source)
    # the block runs from an empty folder of its own, not from tmp_path holding the script
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = _env()
    env["TMPDIR"] = str(tmp_path)  # tempfile.mkdtemp() in a block: inside tmp_path too
    # the package must come from this checkout, not from an installed copy
    run = (f"import os, runpy, jax_seqpar\n"
           f"here = os.path.realpath(os.path.dirname(jax_seqpar.__path__[0]))\n"
           f"assert here == {os.path.realpath(REPO)!r}, jax_seqpar.__path__\n"
           f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", run], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    record_property("cpu_s", round(cpu_s, 1))  # in --junitxml; -s prints it too
    print(f"README block {heading!r}: {cpu_s:.1f} s of CPU")
    assert proc.returncode == 0, (
        f"README block under '{heading}' failed (exit {proc.returncode}):\n"
        f"{textwrap.indent(source, '    ')}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr ---\n{proc.stderr[-8000:]}")
