"""README's "From Python" snippet is examples/python/quickstart.py verbatim, and it runs."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "python", "quickstart.py")


def readme_block():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines(keepends=True)
    start = lines.index("<!-- examples/python/quickstart.py -->\n") + 1
    assert lines[start] == "```python\n"
    end = lines.index("```\n", start + 1)
    return "".join(lines[start + 1:end])


def test_the_readme_shows_the_example_verbatim():
    assert readme_block() == open(EXAMPLE).read()


def test_the_example_runs():
    done = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rows received per rank: [")
