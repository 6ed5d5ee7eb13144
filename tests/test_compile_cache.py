"""``runtime.compile_cache``: the flags, the default folder, and what switching the
persistent compilation cache does.

Switching the cache changes JAX's global configuration, so everything that switches it
runs in child processes (started together: each mostly waits for its imports), never in
the test process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_seqpar.runtime.compile_cache import add_compile_cache_args, default_cache_dir

REPO = Path(__file__).resolve().parents[1]

# A child: apply the flags given on its command line, compile a small jitted function,
# and report what the cache module says and which files appeared.
CHILD = r"""
import argparse, json, os, sys, warnings
import jax, jax.numpy as jnp
from jax_seqpar.runtime import compile_cache as cc

p = cc.add_compile_cache_args(argparse.ArgumentParser())
flags = json.loads(sys.argv[1])
early = flags.pop(0) == "compile-first"  # compile something before the cache is on
if early:
    jax.jit(lambda x: x * 3 - 1)(jnp.arange(5.0)).block_until_ready()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    folder = cc.compile_cache_from_args(p.parse_args(flags))
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
f(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"folder": folder, "in_use": cc.compile_cache_dir(),
                  "stats": cc.compile_cache_stats(), "summary": cc.compile_cache_summary(),
                  "warnings": [str(w.message) for w in caught],
                  "devices": jax.device_count()}))
"""


def _children(tmp_path, runs):
    """Run every ``(devices, env, flags)`` of ``runs`` at once; their JSON reports."""
    procs = []
    for devices, env_extra, flags in runs:
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
        flags_env = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                             if "xla_force_host_platform_device_count" not in f)
        env.update(XLA_FLAGS=f"{flags_env} --xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu", HOME=str(tmp_path / "home"),
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
        env.pop("XDG_CACHE_HOME", None)
        env.update(env_extra)
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(flags)],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _entries(folder) -> list[str]:
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_flags_parse():
    p = add_compile_cache_args(argparse.ArgumentParser())
    a = p.parse_args([])
    assert a.compile_cache is None and a.no_compile_cache is False
    assert p.parse_args(["--compile-cache", "some/dir"]).compile_cache == "some/dir"
    assert p.parse_args(["--no-compile-cache"]).no_compile_cache is True
    with pytest.raises(SystemExit):  # one or the other
        p.parse_args(["--compile-cache", "d", "--no-compile-cache"])
    assert "--compile-cache" in p.format_help() and "XDG_CACHE_HOME" in p.format_help()


def test_default_folder_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "jax_seqpar" / "xla")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored (XDG spec)
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "jax_seqpar" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "jax_seqpar" / "xla")


def test_negative_threshold_is_refused():
    from jax_seqpar.runtime.compile_cache import enable_compile_cache

    with pytest.raises(ValueError, match="min_compile_time_secs"):
        enable_compile_cache("unused", min_compile_time_secs=-1.0)


def test_switching_the_cache_in_child_processes(tmp_path):
    xdg = tmp_path / "xdg"
    default = xdg / "jax_seqpar" / "xla"
    first, off, multi, forced = _children(tmp_path, [
        # one device, no flag: on, in $XDG_CACHE_HOME/jax_seqpar/xla, though a program was
        # compiled before the cache was turned on
        (1, {"XDG_CACHE_HOME": str(xdg)}, ["compile-first"]),
        # --no-compile-cache: off, even when JAX's own variable names a folder
        (1, {"XDG_CACHE_HOME": str(tmp_path / "xdg_off"),
             "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env_dir")},
         ["-", "--no-compile-cache"]),
        # two CPU devices, no flag: off by default (CPU_HAZARD) ...
        (2, {"XDG_CACHE_HOME": str(tmp_path / "xdg_multi")}, ["-"]),
        # ... unless asked for, with a warning
        (2, {}, ["-", "--compile-cache", str(tmp_path / "forced")]),
    ])
    assert first["folder"] == first["in_use"] == str(default)
    written = _entries(default)
    assert first["stats"]["written"] >= 1 and len(written) == first["stats"]["written"]
    assert any(n.startswith("jit__lambda") and n.endswith("-cache") for n in written), written
    assert first["stats"]["hits"] == 0

    assert off["folder"] is None and off["in_use"] is None
    assert "off (--no-compile-cache)" in off["summary"]
    assert _entries(tmp_path / "env_dir") == [] and _entries(tmp_path / "xdg_off") == []

    assert multi["devices"] == 2 and multi["folder"] is None
    assert "several CPU devices" in multi["summary"]
    assert _entries(tmp_path / "xdg_multi") == []
    assert forced["folder"] == str(tmp_path / "forced") and _entries(tmp_path / "forced")
    assert any("deadlock" in w for w in forced["warnings"]), forced["warnings"]

    # A second process that lowers the same program reads it instead of compiling it.
    (again,) = _children(tmp_path, [(1, {"XDG_CACHE_HOME": str(xdg)}, ["compile-first"])])
    assert again["stats"]["hits"] == again["stats"]["requests"] == first["stats"]["requests"]
    assert again["stats"]["written"] == 0 and _entries(default) == written
