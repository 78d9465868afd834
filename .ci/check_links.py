#!/usr/bin/env python3
"""Checks the README and docs/*.md: every relative link and image names a file
that exists, a link with `#anchor` names a heading of its target (by GitHub's
slug), and README.md stays at most MAX_README_LINES lines, so reference text
goes to docs/ instead. Prints each broken link as `file:line: link` and exits
non-zero if there is one. Python 3.11 standard library only; run from anywhere.
"""

import re
import sys
from pathlib import Path
from urllib.parse import unquote

MAX_README_LINES = 400
ROOT = Path(__file__).resolve().parent.parent

# An inline link or image: [text](target) or ![alt](target "title"); the
# text may span lines.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
# A reference definition: [label]: target
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def blank(match: re.Match) -> str:
    """The matched text with everything but its newlines turned to spaces,
    so offsets and line numbers stay as they were."""
    return re.sub(r"[^\n]", " ", match.group(0))


def outside_fences(text: str) -> str:
    """The text with fenced code blocks blanked out: a `#` line there is
    not a heading."""
    lines, fence = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            lines.append("")
        elif fence is not None:
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def prose(text: str) -> str:
    """The text with code blocks and inline code blanked out: brackets
    there are not links."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", blank, outside_fences(text), flags=re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, without
    punctuation other than `-` and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path, cache: dict) -> set:
    if path not in cache:
        seen: dict = {}
        found = set()
        for line in outside_fences(path.read_text(encoding="utf-8")).split("\n"):
            match = HEADING.match(line)
            if not match:
                continue
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        cache[path] = found
    return cache[path]


def check(path: Path, cache: dict) -> list:
    text = prose(path.read_text(encoding="utf-8"))
    targets = [(m.start(), m.group(1)) for m in INLINE.finditer(text)]
    targets += [(m.start(), m.group(1)) for m in REFERENCE.finditer(text)]
    broken = []
    for offset, target in sorted(targets):
        target = target.strip("<>")
        if SCHEME.match(target) or target.startswith("//"):
            continue  # external: not checked here
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        ok = dest.exists()
        if ok and anchor:
            ok = dest.is_file() and dest.suffix == ".md" and unquote(anchor) in anchors(dest, cache)
        if not ok:
            line = text.count("\n", 0, offset) + 1
            broken.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    return broken


def main() -> int:
    readme = ROOT / "README.md"
    files = [readme] + sorted((ROOT / "docs").glob("*.md"))
    problems = []
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    if lines > MAX_README_LINES:
        problems.append(
            f"README.md: {lines} lines, more than {MAX_README_LINES}: move reference text to docs/"
        )
    cache: dict = {}
    for path in files:
        problems += check(path, cache)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {len(files)} files", file=sys.stderr)
        return 1
    print(f"README.md: {lines} lines; links in {len(files)} files resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
