"""Imported first by every benchmark script, before JAX: 8 simulated CPU devices when
there is no accelerator (the flag only affects the host platform), and the repository
root on ``sys.path`` so the scripts run from a checkout without installing."""

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
