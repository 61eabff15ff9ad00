"""README's "From Python" snippets are the example files verbatim, and they run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# Each example, and how its output starts.
EXAMPLES = {
    "examples/python/quickstart.py": "rows received per rank: [",
    "examples/python/readme_example.py": "rank 0: loss ",
}


def readme_block(path):
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines(keepends=True)
    start = lines.index(f"<!-- {path} -->\n") + 1
    assert lines[start] == "```python\n"
    end = lines.index("```\n", start + 1)
    return "".join(lines[start + 1:end])


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_the_readme_shows_the_example_verbatim(path):
    assert readme_block(path) == open(os.path.join(ROOT, path)).read()


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_the_example_runs(path):
    if "torch" in open(os.path.join(ROOT, path)).read():
        pytest.importorskip("torch")
    done = subprocess.run([sys.executable, os.path.join(ROOT, path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(EXAMPLES[path]), done.stdout
