"""Test configuration: 8 simulated CPU devices, shared fixtures.

The environment variables must be set before JAX initialises its backends, so this
module sets them at import time, before anything imports ``jax``.
"""

import os

_FLAGS = {
    # 8 simulated CPU devices for the multi-device tests (docs/ARCHITECTURE.md, "Numerics").
    "--xla_force_host_platform_device_count": "8",
    # Compile each module on one thread.  Numerics are unaffected; without it, two
    # pytest-xdist workers on a 2-core machine compile ~2.5x slower, not 2x faster.
    "--xla_cpu_parallel_codegen_split_count": "1",
}
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in _FLAGS.items():
    if _name not in _flags:  # never duplicate (or override) a flag the user set
        _flags = f"{_flags} {_name}={_value}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import helpers  # noqa: E402  (tests/ is on sys.path: pytest "prepend" import mode)


def pytest_configure(config):
    del config
    n = len(jax.devices())
    if n < 8:  # pragma: no cover - misconfigured environment
        raise pytest.UsageError(
            f"the tests need 8 devices, JAX sees {n}: jax was initialised before "
            f"tests/conftest.py could set XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")


@pytest.fixture
def mesh():
    """Factory: ``mesh(G)`` is a 1-D mesh over the first ``G`` devices, axis ``"sp"``."""
    return helpers.make_mesh


@pytest.fixture
def rel_err():
    return helpers.rel_err


@pytest.fixture
def make_qkv():
    return helpers.make_qkv
