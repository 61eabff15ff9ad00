#!/usr/bin/env python3
"""The docs against the tree and the epx command.

usage: docs_check.py SOURCE_ROOT EPX_BINARY [CHECK ...]

Checks (all by default; name some to run only those):
  layout    README's Layout table: every folder named exists; every top-level
            folder and every src/ folder has a row; a row that names subfolders
            (`x/`) names all of them.
  libraries README's library table against src/CMakeLists.txt: the same
            libraries, and each dependency named is one the build declares.
  options   README's CMake option table against option() in CMakeLists.txt and
            cmake/*.cmake: the same options, and a literal ON/OFF default agrees.
  commands  README's command table against `epx --help` and the help of each
            command that has subcommands: the same commands.
  flags     every --flag in README.md and docs/*.md, given to the command it
            belongs to: epx's (sub)commands by their --help, run now; the
            repository's scripts and benchmarks by their source; other tools by
            the allow-list below.
  links     every relative link of README.md and docs/*.md names a file that
            exists, README's document table lists every docs/*.md, and every
            path of the tree's folders that the docs name exists (a {a,b} or *
            in it expanded).

Exit 0 when every check passes; 1, listing each finding as FILE:LINE: ...,
otherwise; 2 on bad usage.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

# Flags of tools that are not part of epx, by tool, each with why it is named.
ALLOWED = {
    "mpirun": {"--oversubscribe": "more ranks than cores (a 2-core test machine)",
               "--bind-to": "ranks that run several threads", "--map-by": "ranks placed per slot",
               "--host": "hosts without a scheduler", "--mca": "Open MPI component settings",
               "--allow-run-as-root": "a container's root", "--np": "the process count",
               "--report-bindings": "checking the bindings", "--enable-recovery": "each process ends on its own"},
    "srun": {"--mpi": "PMIx start-up for Open MPI", "--nodes": "the allocation", "--ntasks": "the allocation",
             "--ntasks-per-node": "an even number of ranks per node", "--cpus-per-task": "threads per rank",
             "--gpus-per-task": "one GPU per rank", "--kill-on-bad-exit": "stop the step when a rank fails",
             "--time": "the step's time limit", "--export": "environment for the ranks", "--overlap": "a monitor step beside the training",
             "--exclusive": "the step's resources", "--mem": "the step's memory", "--wait": "how long srun waits for the other ranks once one ended",
             "--immediate": "fail when the resources are not there",
             "--distribution": "how ranks are laid out over nodes", "--overcommit": "more ranks than CPUs"},
    "sbatch": {"--nodes": "the allocation", "--ntasks-per-node": "ranks per node", "--cpus-per-task": "threads per rank",
               "--gpus-per-task": "one GPU per rank", "--time": "the job's time limit", "--output": "the job's log",
               "--job-name": "the job's name", "--ntasks": "the allocation", "--exclusive": "whole nodes",
               "--signal": "a warning before the time limit", "--mem": "the job's memory",
               "--wait": "the test waits for its job", "--exclude": "drain a bad host",
               "--requeue": "a preempted job goes back in the queue",
               "--open-mode": "a requeued job appends to its log"},
    "cmake": {"--build": "build a tree", "--install": "install a tree", "--prefix": "the install prefix",
              "--target": "one target", "--parallel": "build jobs"},
    "ctest": {"--test-dir": "the build tree", "--output-on-failure": "show a failing test's output",
              "--label-exclude": "skip labels", "--timeout": "per-test limit", "--no-tests": "fail on an empty selection"},
    "timeout": {"--kill-after": "a second signal after the first"},
    "torchrun": {"--nproc-per-node": "processes per node", "--nnodes": "nodes"},
    "apt-get": {"--no-install-recommends": "what scripts/setup.sh installs"},
    "perf": {"--call-graph": "profiles"},
    "munged": {"--force": "the Slurm test's fresh munge daemon"},
    "unshare": {"--uts": "a host name per emulated host"},
    "node_exporter": {"--collector.textfile.directory": "Prometheus' textfile collector"},
    "nvcc": {"--generate-code": "the CUDA targets CMake passes", "--fmad": "no fused multiply-add on the GPU"},
    "chromium": {"--dump-dom": "the report's browser check", "--headless": "the report's browser check"},
    "gtest": {"--gtest_filter": "one case of a GoogleTest binary"},
    "make": {},
    "python3": {"--system-site-packages": "a venv that sees Debian's numpy and torch (the pip route)",
                "--nproc-per-node": "python3 -m epx.launch: processes per node", "--nnodes": "epx.launch: nodes",
                "--node-rank": "epx.launch: this node", "--master-addr": "epx.launch: node 0's address"},
    "git": {},
    "taskset": {},
}
EXTERNAL = set(ALLOWED) | {"salloc", "pytest", "timeout", "setsid", "time", "env", "sudo", "bash", "sh", "tc", "ip",
                           "ssh", "uptime", "lscpu", "date", "cat", "wc", "ls", "grep", "diff", "awk", "hostname"}
# Files named as arguments, not run.
DATA = (".toml", ".csv", ".json", ".jsonl", ".md", ".txt", ".png", ".html", ".dict", ".supp", ".sbatch")
TREE_PATH = re.compile(r"(?<![\w/.-])((?:src|include|tests|bench|scripts|configs|examples|python|fuzz|apps|cmake|docs)"
                       r"/[\w./{},*-]*[\w*}/])")
# Paths the docs name that are not this tree's, each with why.
OTHER_PATHS = {"configs/x.toml": "the file name of example error messages",
               "tests/legacy/": "DeepEP's repository, whose kernels the simulator models",
               "tests/legacy/test_intranode.py": "DeepEP's repository"}
FLAG = re.compile(r"(?<![\w/.=\"-])--[a-z][a-z0-9_]*(?:[-.][a-z0-9_]+)*")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PROSE_EPX = re.compile(r"\bepx ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")


class Finding(Exception):
    pass


def run_help(epx, words):
    done = subprocess.run([epx, *words, "--help"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise Finding(f"`epx {' '.join(words)} --help` exited {done.returncode}: {done.stderr.strip()[:200]}")
    return done.stdout


def parse_help(text):
    """(flags of the option lines, subcommand names) of one CLI11 help page."""
    flags, subs, section = set(), [], None
    for line in text.split("\n"):
        if re.match(r"^[A-Za-z][A-Za-z ]*:\s*$", line):
            section = line.strip().rstrip(":").lower()
            continue
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("-"):
            first = re.split(r"\s{2,}|\s(?=[A-Z<\[])", stripped)[0]
            flags.update(m for m in re.findall(r"--[a-z][a-z0-9-]*", first))
        elif section == "subcommands" and line.startswith("  "):
            subs.append(stripped.split()[0])
    return flags, subs


class Epx:
    """The command tree of `epx`, read from its --help pages."""

    def __init__(self, binary):
        self.binary = binary
        self.pages = {}
        self._walk(())

    def _walk(self, words):
        flags, subs = parse_help(run_help(self.binary, list(words)))
        self.pages[words] = (flags, subs)
        for sub in subs:
            self._walk(words + (sub,))

    def leaves(self):
        return {" ".join(w) for w, (_, subs) in self.pages.items() if w and not subs}

    def resolve(self, words):
        """The longest command path that `words` starts with."""
        path = ()
        for word in words:
            word = (word or "").rstrip(":").split("/")[0]
            if word in self.pages.get(path, (set(), []))[1]:
                path += (word,)
            else:
                break
        return path

    def flags(self, path):
        return self.pages[path][0]

    def flags_under(self, path):
        """The flags of path and of every command below it."""
        return set().union(*(f for w, (f, _) in self.pages.items() if w[:len(path)] == path))

    def all_flags(self):
        return set().union(*(f for f, _ in self.pages.values()))


def tables(text, header_word):
    """Rows (line number, cells) of the first table whose header's first cell has header_word."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|") and header_word in line.split("|")[1]:
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, [c.strip() for c in lines[j].strip().strip("|").split("|")]))
                j += 1
            return i + 1, rows
    raise Finding(f"README.md: no table with a '{header_word}' column")


def section(text, heading):
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def ticked(cell):
    return re.findall(r"`([^`]+)`", cell)


def check_layout(root, readme, out):
    body = section(readme, "## Layout")
    _, rows = tables(body, "folder")
    offset = readme.index("## Layout")
    line_of = lambda n: readme[:offset].count("\n") + n  # noqa: E731
    named = set()
    for n, cells in rows:
        folders = ticked(cells[0])
        for folder in folders:
            path = root / folder.rstrip("/")
            named.add(folder.rstrip("/"))
            if not path.is_dir():
                out.append(f"README.md:{line_of(n)}: the Layout table names `{folder}`, which is not a folder")
                continue
            subs = [s.rstrip("/") for s in ticked(cells[1]) if s.endswith("/") and "/" not in s.rstrip("/")]
            for sub in subs:
                if not (path / sub).is_dir():
                    out.append(f"README.md:{line_of(n)}: `{folder}` has no subfolder `{sub}/`")
            if subs:
                for child in sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
                    if child not in subs:
                        out.append(f"README.md:{line_of(n)}: the row of `{folder}` names some subfolders but not `{child}/`")
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        if child.name.startswith(".") or child.name.startswith("build") or not tracked(root, child.name):
            continue
        if child.name not in named and not any(n.startswith(child.name + "/") for n in named):
            out.append(f"README.md: the Layout table has no row for `{child.name}/`")
    for child in sorted(p.name for p in (root / "src").iterdir() if p.is_dir()):
        if f"src/{child}" not in named:
            out.append(f"README.md: the Layout table has no row for `src/{child}`")


def tracked(root, name):
    """Whether git tracks anything under name (true outside a git checkout)."""
    done = subprocess.run(["git", "-C", str(root), "ls-files", "--", name], capture_output=True, text=True)
    return done.returncode != 0 or bool(done.stdout.strip())


def cmake_deps(cmake_text, deps_text):
    """The names of DEPS, with ${var} expanded from set()/list(APPEND) of the file."""
    names = set()
    for token in deps_text.split():
        var = re.fullmatch(r"\$\{(\w+)\}", token)
        if var:
            for m in re.finditer(r"(?:set|list\(APPEND)\(?\s*" + var.group(1) + r"\s+([^)]*)\)", cmake_text):
                names.update(m.group(1).split())
        else:
            names.add(token)
    return names


def check_libraries(root, readme, out):
    cmake_text = (root / "src" / "CMakeLists.txt").read_text()
    built = {m.group(1): cmake_deps(cmake_text, m.group(2)) for m in
             re.finditer(r"epx_add_layer\((\w+) SOURCES \S+ DEPS ([^)]*)\)", cmake_text)}
    cuda = re.search(r"add_library\(epx_cuda .*?target_link_libraries\(epx_cuda PUBLIC ([^)]*)\)", cmake_text, re.S)
    if cuda:
        built["epx_cuda"] = set(cuda.group(1).split())
    head, rows = tables(readme, "library")
    listed = {}
    for n, cells in rows:
        name = ticked(cells[0])[0]
        listed[name] = n
        for folder in ticked(cells[1]):
            if not (root / folder).is_dir():
                out.append(f"README.md:{n}: `{name}`'s folder `{folder}` does not exist")
        for dep in (d for d in ticked(cells[2]) if d.startswith("epx_")):
            if name in built and dep not in built[name]:
                out.append(f"README.md:{n}: `{name}` is said to depend on `{dep}`; src/CMakeLists.txt does not link it")
    for name in sorted(set(built) - set(listed)):
        out.append(f"README.md:{head}: the library table misses `{name}` (src/CMakeLists.txt builds it)")
    for name in sorted(set(listed) - set(built)):
        out.append(f"README.md:{listed[name]}: `{name}` is not a library src/CMakeLists.txt builds")


def check_options(root, readme, out):
    declared = {}
    for path in [root / "CMakeLists.txt", *sorted((root / "cmake").glob("*.cmake"))]:
        for m in re.finditer(r'^\s*option\((\w+)\s+"[^"]*"\s+([^)\s]+)\)', path.read_text(), re.M):
            declared[m.group(1)] = m.group(2)
    head, rows = tables(readme, "CMake option")
    listed = {}
    for n, cells in rows:
        name = ticked(cells[0])[0]
        listed[name] = n
        default = declared.get(name)
        if default in ("ON", "OFF") and not cells[1].startswith(f"`{default}`"):
            out.append(f"README.md:{n}: `{name}` defaults to {default} in CMake, the table says {cells[1]}")
    for name in sorted(set(declared) - set(listed)):
        out.append(f"README.md:{head}: the CMake option table misses `{name}`")
    for name in sorted(set(listed) - set(declared)):
        out.append(f"README.md:{listed[name]}: `{name}` is not a CMake option of this tree")


def check_commands(readme, epx, out):
    head, rows = tables(readme, "command")
    listed = {}
    for n, cells in rows:
        words = ticked(cells[0])[0].split()
        if words[0] != "epx":
            out.append(f"README.md:{n}: `{' '.join(words)}` is not an epx command")
            continue
        listed[" ".join(w for w in words[1:] if not w.startswith(("-", "[")) and w.islower())] = n
    leaves = epx.leaves()
    for name in sorted(leaves - set(listed)):
        out.append(f"README.md:{head}: the command table misses `epx {name}` (it is in `epx --help`)")
    for name in sorted(set(listed) - leaves):
        out.append(f"README.md:{listed[name]}: `epx {name}` is not a command of `epx --help`")


def program_of(token, root):
    """('epx', None), ('tool', name), ('file', paths) or None for one token."""
    token = token.strip("\"'();")
    if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", token):
        return None
    base = token.rsplit("/", 1)[-1]
    if base == "epx" or token in ("${epx}", "$EPX", "${EPX}", "$epx"):
        return ("epx", None)
    if token.startswith("#SBATCH"):
        return ("tool", "sbatch")
    if re.fullmatch(r"\$<TARGET_FILE:\w+_tests>", token):
        return ("tool", "gtest")
    if token.endswith(DATA):
        return None
    if base in EXTERNAL or token == "/usr/bin/python3":
        return ("tool", "python3" if base.startswith("python3") else base)
    if "/" in token and (root / token).is_file():
        return ("file", [root / token])
    if "/" not in token and token.endswith((".sh", ".py")):
        found = [p for p in root.rglob(token) if not p.relative_to(root).parts[0].startswith(("build", "."))]
        if found:
            return ("file", found)
    m = re.fullmatch(r"(?:\./)?build[\w-]*/(?:bin|bench|tests/mpi)/([\w-]+)", token)
    if m:
        stem = m.group(1).removeprefix("epx_")
        sources = [p for p in (root / "bench").glob(stem + ".*")] + list((root / "tests").rglob(stem + ".*"))
        return ("file", sources)
    return None


def segments(path, text):
    """(line number, text, kind) of every code line and inline code span, and of prose lines."""
    in_code = False
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_code = not in_code
            yield i + 1, "", "break"
            i += 1
            continue
        if in_code:
            start = i
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            yield start + 1, line, "code"
        elif not line.strip():
            yield i + 1, "", "break"
        else:
            yield i + 1, line, "prose"
        i += 1


def check_flags_in(path, text, epx, root, out):
    all_epx = epx.all_flags()
    any_allowed = set().union(*ALLOWED.values())
    context = None  # the paragraph's last program: ("epx", path) | ("tool", name) | ("file", paths)
    heading_context = None
    for n, line, kind in segments(path, text):
        if kind == "break":
            context = None
            continue
        if kind == "prose" and line.startswith("#"):
            context = None
            m = PROSE_EPX.search(line)
            heading_context = ("epx", epx.resolve(m.groups())) if m else None
            continue
        if kind == "prose" and line.startswith("|"):
            context = None  # each table row stands alone
        pieces = [line] if kind == "code" else CODE_SPAN.findall(line)
        if kind == "prose":
            m = None
            for m in PROSE_EPX.finditer(CODE_SPAN.sub("", line)):
                pass
            if m and m.group(1) in epx.pages[()][1]:
                context = ("epx", epx.resolve([w for w in m.groups() if w]))
        for piece in pieces:
            check_piece(path, n, piece, epx, root, out, context, heading_context, all_epx, any_allowed)
            last = last_program(piece, epx, root)
            if last:
                context = last


def words_of(piece):
    return [w for w in re.split(r"\s+", piece.split(" #")[0].strip()) if w]


def last_program(piece, epx, root):
    current = None
    words = words_of(piece)
    for i, word in enumerate(words):
        prog = program_of(word, root)
        if prog and prog[0] == "epx":
            current = ("epx", epx.resolve([w for w in words[i + 1:] if not w.startswith("-")][:3]))
        elif prog:
            current = prog
    return current


def check_piece(path, n, piece, epx, root, out, context, heading_context, all_epx, any_allowed):
    code, _, comment = piece.partition(" #")
    words = words_of(code)
    usage = bool(words) and words[0].startswith("-")  # a usage line: options of the program above
    current = None
    previous = before = ""
    for at, word in enumerate(words):
        prog = None if usage or word.startswith("-") else program_of(word, root)
        if prog and current and current[0] == "file" and previous.startswith("--") and previous != "--" \
                and "=" not in previous:
            prog = None  # the value of a script's option, such as --epx build/bin/epx
        if prog and prog[0] == "file" and "--mca" in (previous, before):
            prog = None  # an Open MPI setting's value, such as --mca plm_rsh_agent tests/mpi/fake-ssh
        if prog and prog[0] == "epx":
            rest = []
            for w in words[at + 1:]:
                if w.startswith("-"):
                    break
                rest.append(w)
            current = ("epx", epx.resolve(rest))
        elif prog:
            current = prog
        for flag in FLAG.findall(word):
            judge(path, n, flag, current or context or heading_context, epx, root, out, all_epx, any_allowed,
                  strict=current is not None)
        before, previous = previous, word
    for flag in FLAG.findall(comment):
        judge(path, n, flag, current or context or heading_context, epx, root, out, all_epx, any_allowed, strict=False)


def repo_sources(root):
    """The text of the repository's scripts and benchmark and test programs, once."""
    if not hasattr(repo_sources, "text"):
        files = [*root.glob("bench/*"), *root.glob("scripts/*"), *root.rglob("tests/**/*.sh"),
                 *root.rglob("tests/**/*.py"), *root.rglob("tests/**/*.c"), *root.glob("examples/**/*.py")]
        repo_sources.text = "\n".join(p.read_text(errors="replace") for p in files if p.is_file())
    return repo_sources.text


def known_anywhere(flag, root, all_epx, any_allowed):
    return flag in all_epx or flag in any_allowed or re.search(re.escape(flag) + r"(?![\w-])", repo_sources(root))


def judge(path, n, flag, owner, epx, root, out, all_epx, any_allowed, strict):
    """Whether flag belongs to owner; where the owner was inferred (not on the flag's own line or
    span), a flag known to epx, the allow-list or the repository's own programs passes too."""
    where = f"{path}:{n}"
    if owner is None:
        if not known_anywhere(flag, root, all_epx, any_allowed):
            out.append(f"{where}: {flag} is no flag of any epx command, allowed tool or program of the tree")
        return
    kind, what = owner
    if kind == "epx":
        ok = flag in epx.flags_under(what)
        name = " ".join(("epx",) + what)
        problem = f"{flag} is not an option of `{name}` (`{name} --help`)"
    elif kind == "tool":
        ok = flag in ALLOWED.get(what, {})
        problem = f"{flag} of `{what}` is not in tests/docs/docs_check.py's allow-list"
    else:
        ok = any(p.is_file() and flag in p.read_text(errors="replace") for p in what)
        problem = f"{flag} is not in the source of {', '.join(str(p) for p in what) or 'a program with no source here'}"
    if not ok and (strict or not known_anywhere(flag, root, all_epx, any_allowed)):
        out.append(f"{where}: {problem}")


def doc_files(root):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def check_flags(root, epx, out):
    for path in doc_files(root):
        check_flags_in(path.relative_to(root), path.read_text(), epx, root, out)


def check_links(root, readme, out):
    for path in doc_files(root):
        for n, line in enumerate(path.read_text().split("\n"), 1):
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                if not (path.parent / target).exists():
                    out.append(f"{path.relative_to(root)}:{n}: the link {target} names nothing in the tree")
    for path in doc_files(root):
        for n, line in enumerate(path.read_text().split("\n"), 1):
            for named in TREE_PATH.findall(line):
                check_tree_path(root, path, n, named, out)
    docs_table = section(readme, "## Documents")
    for doc in sorted((root / "docs").glob("*.md")):
        if f"docs/{doc.name}" not in docs_table:
            out.append(f"README.md: the Documents table misses docs/{doc.name}")


def check_tree_path(root, doc, n, named, out):
    if named in OTHER_PATHS or re.search(r"/(?:[A-Z]+|N+)(?:/|$|\.)", named):
        return  # not this tree's, or a placeholder such as fuzz/regressions/NAME/
    brace = re.search(r"\{([^}]*)\}", named)
    variants = [named[:brace.start()] + v + named[brace.end():] for v in brace.group(1).split(",")] if brace else [named]
    for variant in variants:
        if not list(root.glob(variant.rstrip("/"))):
            out.append(f"{doc.relative_to(root)}:{n}: {variant} is not in the tree")


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    root, binary = Path(argv[1]), argv[2]
    chosen = argv[3:] or ["layout", "libraries", "options", "commands", "flags", "links"]
    readme = (root / "README.md").read_text()
    out = []
    epx = None
    for check in chosen:
        try:
            if check in ("commands", "flags") and epx is None:
                epx = Epx(binary)
            {"layout": lambda: check_layout(root, readme, out),
             "libraries": lambda: check_libraries(root, readme, out),
             "options": lambda: check_options(root, readme, out),
             "commands": lambda: check_commands(readme, epx, out),
             "flags": lambda: check_flags(root, epx, out),
             "links": lambda: check_links(root, readme, out)}[check]()
        except KeyError:
            print(f"unknown check {check}", file=sys.stderr)
            return 2
        except (Finding, ValueError) as e:
            out.append(f"{check}: {e}")
    for line in out:
        print(line)
    print(f"{', '.join(chosen)}: {len(out)} findings")
    return 1 if out else 0


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    sys.exit(main(sys.argv))
