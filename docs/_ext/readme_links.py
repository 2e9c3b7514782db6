"""Check the relative links of Markdown files outside the Sphinx build (README.md and the like).

``python docs/_ext/readme_links.py README.md CHANGELOG.md``: every ``[text](target)`` whose target
is not a URL must name a file of the repository, and its ``#anchor``, if any, a heading of that
Markdown file (GitHub's and MyST's slug: lower case, punctuation dropped, spaces to hyphens), or of
the file itself for ``(#anchor)``. Exits 1 listing the broken links.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside code fences, with their line numbers."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for _, line in prose_lines(path) if (m := HEADING.match(line))}


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # a URL (https:, mailto:)
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{path}:{number}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{path}:{number}: {target}: no heading with the anchor #{anchor} in {linked.name}")
    return problems


if __name__ == "__main__":
    found = [problem for name in sys.argv[1:] for problem in broken_links(Path(name))]
    sys.stderr.writelines(f"{problem}\n" for problem in found)
    sys.exit(1 if found else 0)
