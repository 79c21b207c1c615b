"""The documentation site builds without a warning, and the README's links lead somewhere.

``mkdocs build --strict`` fails on a page missing from the nav, a link to a page or an anchor
that does not exist, and any other warning, so a doc that drifts from the tree fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_every_relative_link_of_the_readme_names_a_file_in_the_tree() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme) if "://" not in t]
    assert targets, "the README links the documentation"
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_the_readme_is_a_front_door_a_newcomer_reads_in_minutes() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 250
