"""Every relative link in BENCHMARKS.md, README.md and docs/*.md, and every repository path they quote in backticks,
names something that exists (files move: bench/results/, bench/tuning/)."""

import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "BENCHMARKS.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             REPO / "bench" / "tuning" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a path from the repository root, or (../) from the document's directory
QUOTED = re.compile(r"`((?:\.\./)+[^`\s]+|(?:bench|docs|examples|recipes|schema|src|tests|verification)/[^`\s]+)`")


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> [abd, acd] (nested braces are not used in these documents)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _exists(base: Path, target: str) -> bool:
    return all(any(base.glob(p)) if "*" in p else (base / p).exists() for p in _expand(target.rstrip("/")))


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d.is_file()], ids=lambda d: str(d.relative_to(REPO)))
def test_links_and_quoted_paths_exist(document):
    text = document.read_text()
    missing = []
    for number, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            target = target.split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not _exists(document.parent, target):
                missing.append(f"{document.name}:{number}: link {target}")
        for target in QUOTED.findall(line):
            target = target.rstrip(".,;:)")
            if "..." in target or "DATE" in target or "<" in target:
                continue  # an abbreviation or a placeholder, not a path
            base = document.parent if target.startswith("../") else REPO
            if not _exists(base, target.split("::")[0].split(":")[0]):
                missing.append(f"{document.name}:{number}: {target}")
    assert not missing, "\n".join(missing)
