"""Issue 15: packaging metadata and the training example's kernel choice."""

import os
import pathlib
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_pyproject_uses_an_spdx_license_string():
    """PEP 639: ``license = "<SPDX expression>"``; the table form is deprecated (setuptools
    warns on every build and will stop accepting it), and setuptools >= 77 reads the
    string form."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"]


def _example(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(REPO / "examples" / "train_long_context.py"),
                           *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_example_refuses_block_for_another_kernel(tmp_path):
    """``--block`` sets the xla kernel's tiles; asking for it with another kernel is an
    error that says so (the run prints which kernel it uses: tests/test_multiprocess.py)."""
    r = _example("--kernel", "pallas", "--block", "64", "--steps", "1", "--out", str(tmp_path))
    assert r.returncode != 0
    assert "--block=64 sets the xla kernel's tiles" in r.stderr + r.stdout
