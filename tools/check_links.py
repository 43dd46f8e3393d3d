"""Every relative link in the repository's Markdown (README.md, BENCHMARKS.md, tests/README.md, docs/**) points at a
file that exists and, for ``file.md#anchor`` or ``#anchor``, at a heading (GitHub's slug) or an ``<a id="...">`` of
that file. Links with a scheme (https:, mailto:) are not checked. Run by tools/lint.sh; prints each broken link as
``file:line: target`` and exits 1 when there is one.

    python3 tools/check_links.py [FILE.md ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
FENCE = re.compile(r"^\s*(```|~~~)")


def default_files() -> list:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "tests" / "README.md"]
    return [f for f in files if f.exists()] + sorted((ROOT / "docs").rglob("*.md"))


def slug(text: str) -> str:
    """GitHub's heading anchor: markup dropped, lower case, punctuation but '-' and '_' removed, spaces -> '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def lines_outside_code(path: Path):
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def anchors(path: Path, cache: dict) -> set:
    if path not in cache:
        found, seen = set(), {}
        for _, line in lines_outside_code(path):
            m = HEADING.match(line)
            if m:
                s = slug(m.group(2))
                k = seen.get(s, 0)
                seen[s] = k + 1
                found.add(s if k == 0 else f"{s}-{k}")
            found.update(ANCHOR.findall(line))
        cache[path] = found
    return cache[path]


def check(path: Path, cache: dict) -> list:
    bad = []
    for n, line in lines_outside_code(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest, cache):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such anchor)")
    return bad


def main(argv: list) -> int:
    files = [Path(a).resolve() for a in argv] or default_files()
    cache: dict = {}
    bad = [b for f in files for b in check(f, cache)]
    for b in bad:
        print(b)
    print(f"links: {len(files)} Markdown files, {len(bad)} broken link(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
