"""The PEP 517 build backend behind `pip install .` (docs/python.md).

It builds the Python module with the project's own CMake build, for the
interpreter that runs it (sys.executable, so a venv's python gets a module for
its own version), and packs build/python/epx/ into a wheel. Nothing is
downloaded: CMake, the compiler, pybind11 and numpy come from the machine
(scripts/setup.sh installs them on Debian), so pip runs it with
--no-build-isolation.

Settings, from the environment:
  EPX_PIP_BUILD_DIR  the CMake build folder (default: build-pip/ in the source
                     tree, beside build/, so ccache serves what `make build`
                     compiled; kept, so a second install is incremental)
  EPX_CMAKE_ARGS     extra CMake arguments, e.g. "-DEPX_WITH_MPI=OFF"
  EPX_JOBS           parallel compile jobs (default: the number of CPUs)
  EPX_CCACHE=0       do not compile through ccache even where it is installed

Only wheels are built: an sdist or an editable install is refused by pip
with its own message (the hooks are not defined here).
"""

import base64
import csv
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

_SOURCE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _project():
    """Name, version and metadata fields: pyproject.toml, the version from CMakeLists.txt."""
    with open(os.path.join(_SOURCE, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(_SOURCE, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(epx VERSION ([0-9.]+)", f.read())
    if match is None:
        raise RuntimeError("epx_build: no `project(epx VERSION x.y.z` line in CMakeLists.txt")
    project["version"] = match.group(1)
    return project


def _tag():
    """The wheel's tag for this interpreter, e.g. cp311-cp311-linux_x86_64."""
    if sys.implementation.name != "cpython":
        raise RuntimeError(f"epx_build: the module is built for CPython, not {sys.implementation.name}")
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{python}-{python}-{platform}"


def _metadata_text(project):
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}",
             f"Summary: {project.get('description', '')}"]
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    if "license" in project:
        lines.append(f"License: {project['license'].get('text', '')}")
    for requirement in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {requirement}")
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines.extend(f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements)
    return "\n".join(lines) + "\n"


def _dist_info_files(project):
    """The .dist-info files other than RECORD, as {name: bytes}."""
    wheel = f"Wheel-Version: 1.0\nGenerator: epx_build\nRoot-Is-Purelib: false\nTag: {_tag()}\n"
    files = {"METADATA": _metadata_text(project).encode(), "WHEEL": wheel.encode()}
    license_path = os.path.join(_SOURCE, "LICENSE")
    if os.path.exists(license_path):
        with open(license_path, "rb") as f:
            files["LICENSE"] = f.read()
    return files


def _dist_info_name(project):
    return f"{project['name']}-{project['version']}.dist-info"


def _run(command, env):
    print("epx_build:", shlex.join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def _cmake_build():
    """Configures and builds the epx_python target; returns the folder holding the package."""
    build = os.environ.get("EPX_PIP_BUILD_DIR") or os.path.join(_SOURCE, "build-pip")
    env = dict(os.environ)
    args = ["cmake", "-S", _SOURCE, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython3_EXECUTABLE={sys.executable}", "-DEPX_BUILD_PYTHON=ON", "-DEPX_BUILD_TESTS=OFF",
            "-DEPX_BUILD_BENCH=OFF", "-DEPX_BUILD_APPS=OFF"]
    if env.get("EPX_CCACHE", "1") != "0" and shutil.which("ccache"):
        args += [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in ("C", "CXX", "CUDA")]
        env.setdefault("CCACHE_BASEDIR", _SOURCE)
        env.setdefault("CCACHE_NOHASHDIR", "1")
    args += shlex.split(env.get("EPX_CMAKE_ARGS", ""))
    _run(args, env)
    # The package folder is assembled anew, so a kept build folder holds no file
    # the sources no longer have (nor a module of another Python).
    shutil.rmtree(os.path.join(build, "python", "epx"), ignore_errors=True)
    jobs = env.get("EPX_JOBS") or str(os.cpu_count() or 1)
    _run(["cmake", "--build", build, "--target", "epx_python", "-j", jobs], env)
    return os.path.join(build, "python")


def _package_files(package_root):
    """(path on disk, path in the wheel) for epx/**: the .py files and the extension."""
    found = []
    for folder, _, names in os.walk(os.path.join(package_root, "epx")):
        for name in sorted(names):
            if name.endswith(".py") or (name.startswith("_epx") and name.endswith(".so")):
                path = os.path.join(folder, name)
                found.append((path, os.path.relpath(path, package_root)))
    if not any(arc.startswith("epx/_epx") for _, arc in found):
        raise RuntimeError(f"epx_build: the extension epx/_epx*.so was not built under {package_root}")
    return found


def _record_row(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [arcname, f"sha256={digest}", str(len(data))]


def _write_wheel(path, entries, dist_info):
    """entries: [(arcname, bytes)]; RECORD is computed and written last."""
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for arcname, data in entries:
            wheel.writestr(arcname, data)
            writer.writerow(_record_row(arcname, data))
        writer.writerow([f"{dist_info}/RECORD", "", ""])
        wheel.writestr(f"{dist_info}/RECORD", record.getvalue())


# The PEP 517 hooks.

def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project = _project()
    name = _dist_info_name(project)
    os.makedirs(os.path.join(metadata_directory, name), exist_ok=True)
    for file, data in _dist_info_files(project).items():
        with open(os.path.join(metadata_directory, name, file), "wb") as f:
            f.write(data)
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    package_root = _cmake_build()
    entries = []
    for path, arcname in _package_files(package_root):
        with open(path, "rb") as f:
            entries.append((arcname, f.read()))
    dist_info = _dist_info_name(project)
    entries += [(f"{dist_info}/{file}", data) for file, data in _dist_info_files(project).items()]
    wheel_name = f"{project['name']}-{project['version']}-{_tag()}.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    _write_wheel(os.path.join(wheel_directory, wheel_name), entries, dist_info)
    return wheel_name
