"""Issue 15: the repository documents itself; nothing in it points outside it."""

import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in names:
        path = REPO / name
        if path.suffix in (".py", ".md", ".ipynb", ".toml", ".cfg", ".txt", ".sh") or \
                path.name in ("Makefile",):
            yield path


def test_architecture_document_exists_and_the_readme_links_it():
    arch = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for heading in ("## Layers", "## The local-kernel contract", "## Adding a strategy",
                    "## Adding a backend", "## Numerics", "## GPU checks"):
        assert heading in arch, heading
    assert "(docs/ARCHITECTURE.md)" in (REPO / "README.md").read_text()


def test_nothing_points_outside_the_repository():
    offenders = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for needle in ("../shared", "DESIGN.md"):
            if needle in text and path.name != "test_docs.py":
                offenders.append(f"{path.relative_to(REPO)}: {needle}")
    assert not offenders, offenders
