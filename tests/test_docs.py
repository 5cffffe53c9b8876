"""The documentation's shape: a short README that links to the status page, package READMEs of at
most 30 lines, and no reference a reader of the repository cannot follow (tracker items, sections of
documents that are not in it)."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_CHARS = 8000
PACKAGE_README_MAX_LINES = 30
PACKAGES = ("kernels", "models", "memory", "rollout", "trainer", "rl", "benchmarks")
# Built from pieces so that this file does not match itself.
UNFOLLOWABLE = re.compile("|".join(("issue" + r" [0-9]", "SP" + "EC §", "seed" + r" 00[0-9]")))


def tracked(*patterns: str) -> list[Path]:
    """The files git tracks that match `patterns`, those deleted in the working tree left out."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / name for name in out.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def test_readme_is_short():
    size = len((ROOT / "README.md").read_text(encoding="utf-8"))
    assert size <= README_MAX_CHARS, f"README.md has {size} characters, at most {README_MAX_CHARS}"


def test_readme_links_to_the_status_page():
    assert (ROOT / "docs" / "status.md").is_file()
    assert "](docs/status.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_no_unfollowable_references():
    files = tracked("*.py", "*.md")
    assert files, "git ls-files found nothing"
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
            for path in files
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if UNFOLLOWABLE.search(line)]
    assert not hits, "references a reader cannot follow (state the rule instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_readme_is_short(package):
    path = ROOT / package / "README.md"
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= PACKAGE_README_MAX_LINES, f"{package}/README.md has {lines} lines, at most {PACKAGE_README_MAX_LINES}"
