#!/usr/bin/env python3
"""Every table in docs/performance.md names the commit it measured.

A table (a run of lines starting with '|') passes when the text between the
nearest heading above it and the table names a commit: the word "commit" (any
case) and, on the same line, a hex name of 7 to 40 characters. Where the
source tree is a git checkout, each name must resolve to a commit there.
A table that holds no measurement (a method or machine description) is
marked with `<!-- not a measurement -->` in that same text instead.

Exit 0 when every table passes; 1, listing file:line of each table that does
not, otherwise; 2 on bad usage.
"""
import re
import subprocess
import sys
from pathlib import Path

HEX = re.compile(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
EXEMPT = "<!-- not a measurement -->"


def tables(lines):
    """(line number of the table, text between its heading and it)."""
    heading_at, in_table = 0, False
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading_at = i
        is_row = line.startswith("|")
        if is_row and not in_table:
            yield i + 1, "\n".join(lines[heading_at:i])
        in_table = is_row


def full_history(root):
    """True in a git checkout that holds its whole history (not shallow)."""
    if not (root / ".git").exists():
        return False
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-shallow-repository"],
                          capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


def commits_among(root, names):
    """The names that are commits of the repository at root (one git call)."""
    query = "".join(f"{n}^{{commit}}\n" for n in names)
    done = subprocess.run(["git", "-C", str(root), "cat-file", "--batch-check"], input=query,
                          capture_output=True, text=True)
    answers = done.stdout.split("\n")
    return {n for n, a in zip(names, answers) if a and not a.endswith("missing")}


def main(argv):
    if len(argv) != 2:
        print("usage: benchmark_commits.py SOURCE_ROOT", file=sys.stderr)
        return 2
    root = Path(argv[1])
    path = root / "docs" / "performance.md"
    lines = path.read_text().split("\n")
    found = list(tables(lines))
    named = sorted({n for _, before in found for n in HEX.findall(before)})
    known = commits_among(root, named) if full_history(root) else set(named)
    bad = []
    for line_no, before in found:
        if EXEMPT in before:
            continue
        names = HEX.findall(before)
        if not names:
            bad.append(f"{path}:{line_no}: the table names no commit (add 'commit <hash>' above it)")
        elif not known.intersection(names):
            bad.append(f"{path}:{line_no}: none of {', '.join(names)} is a commit of this repository")
    for message in bad:
        print(message)
    print(f"{len(found)} tables, {len(bad)} without a commit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
