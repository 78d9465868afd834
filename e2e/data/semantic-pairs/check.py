#!/usr/bin/env python3
"""Validate pairs.jsonl, the labelled question pairs for the semantic response cache.

Usage: python3 check.py [path/to/pairs.jsonl]   (defaults to pairs.jsonl beside this file)

Prints the counts per kind and label and exits 1 when the file breaks a rule:
each line one JSON object with exactly the fields id, a, b, same, kind;
ids unique; a and b non-empty, trimmed-distinct strings of 3 to 40 words;
same a boolean that matches its kind; no pair repeated (in either order, ignoring
case, punctuation and whitespace); a case_punct pair differs only in case,
punctuation and whitespace, and no other pair does; at least 260 pairs and at
least 30 case_punct pairs.
"""
import collections
import json
import os
import re
import sys

SAME_KINDS = ("case_punct", "reorder", "synonym", "paraphrase")
DIFFERENT_KINDS = ("negation", "entity", "scope", "topic", "direction")
FIELDS = {"id": str, "a": str, "b": str, "same": bool, "kind": str}
MIN_PAIRS = 260
MIN_CASE_PUNCT = 30
MIN_WORDS, MAX_WORDS = 3, 40
ID_RE = re.compile(r"^p\d{3,}$")


def normalized(text):
    """The text with case, punctuation and whitespace dropped."""
    return re.sub(r"[\W_]+", "", text.lower())


def check(path):
    problems = []
    counts = collections.Counter()
    seen_ids = set()
    seen_pairs = {}
    lengths = []
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            where = f"line {lineno}"
            if not line.strip():
                problems.append(f"{where}: blank line")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not JSON: {e}")
                continue
            if not isinstance(row, dict):
                problems.append(f"{where}: not a JSON object")
                continue
            n += 1
            missing = [k for k in FIELDS if k not in row]
            extra = sorted(set(row) - set(FIELDS))
            if missing:
                problems.append(f"{where}: missing fields {missing}")
            if extra:
                problems.append(f"{where}: unknown fields {extra}")
            wrong = [k for k, t in FIELDS.items() if k in row and type(row[k]) is not t]
            if wrong:
                problems.append(f"{where}: wrong types for {wrong}")
            if missing or wrong:
                continue
            pid, a, b, same, kind = row["id"], row["a"], row["b"], row["same"], row["kind"]
            where = f"line {lineno} ({pid})"
            if not ID_RE.match(pid):
                problems.append(f"{where}: id should look like p001")
            if pid in seen_ids:
                problems.append(f"{where}: duplicate id")
            seen_ids.add(pid)
            for name, text in (("a", a), ("b", b)):
                if not text.strip():
                    problems.append(f"{where}: {name} is empty")
                    continue
                if "\n" in text or "\r" in text:
                    problems.append(f"{where}: {name} has a line break")
                words = len(text.split())
                lengths.append(words)
                if not MIN_WORDS <= words <= MAX_WORDS:
                    problems.append(f"{where}: {name} has {words} words, want {MIN_WORDS}..{MAX_WORDS}")
            if a.strip() == b.strip():
                problems.append(f"{where}: a and b are the same string")
            if kind in SAME_KINDS:
                if same is not True:
                    problems.append(f"{where}: kind {kind} needs same: true")
            elif kind in DIFFERENT_KINDS:
                if same is not False:
                    problems.append(f"{where}: kind {kind} needs same: false")
            else:
                problems.append(f"{where}: unknown kind {kind!r}")
            na, nb = normalized(a), normalized(b)
            if kind == "case_punct" and na != nb:
                problems.append(f"{where}: case_punct pair differs in more than case, punctuation or whitespace")
            if kind != "case_punct" and na == nb:
                problems.append(f"{where}: differs only in case, punctuation or whitespace but kind is {kind}")
            key = tuple(sorted((na, nb)))
            if key in seen_pairs:
                problems.append(f"{where}: same pair as {seen_pairs[key]}")
            else:
                seen_pairs[key] = pid
            counts[(kind, same)] += 1

    if n < MIN_PAIRS:
        problems.append(f"{n} pairs, want at least {MIN_PAIRS}")
    if counts[("case_punct", True)] < MIN_CASE_PUNCT:
        problems.append(f"{counts[('case_punct', True)]} case_punct pairs, want at least {MIN_CASE_PUNCT}")

    print(f"{path}: {n} pairs")
    for label, kinds in ((True, SAME_KINDS), (False, DIFFERENT_KINDS)):
        total = sum(counts[(k, label)] for k in kinds)
        print(f"same={str(label).lower()}: {total}")
        for k in kinds:
            print(f"  {k:<11} {counts[(k, label)]}")
    stray = {k: v for k, v in counts.items() if k[0] not in SAME_KINDS + DIFFERENT_KINDS}
    if stray:
        print(f"other: {stray}")
    if lengths:
        print(f"words per question: min {min(lengths)}, max {max(lengths)}, mean {sum(lengths) / len(lengths):.1f}")

    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(check(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "pairs.jsonl")))
