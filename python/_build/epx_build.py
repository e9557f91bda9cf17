"""In-tree PEP 517 build backend: `pip install .` builds libepx.so with CMake and packs it with the pure-Python
package into a py3-none-<platform> wheel.

Why not setuptools: this backend needs nothing but the standard library, so `pip install .` works offline
with or without build isolation, on any setuptools (old ones cannot build wheels without the `wheel`
package). Metadata comes from pyproject.toml's [project] table.

Environment:
  EPX_PREBUILT_LIBRARY  an existing libepx.so to ship instead of building one
  EPX_CMAKE_BUILD_DIR   the CMake build folder (default: build-python in the repository)
  EPX_BUILD_JOBS        parallel build jobs (default: the CPU count)
  EPX_CMAKE, EPX_NINJA  the cmake / ninja executables (default: the first on PATH that runs; a virtual
                        environment's pip-installed `cmake` script fails inside pip's isolated build, whose
                        sys.path hides the module it imports: then the binary that package ships is used,
                        or a later one on PATH)
"""

import base64
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "python", "epx")


# ---- metadata ---------------------------------------------------------------------------------------------------
def _project():
    """name, version, description, requires-python and optional dependencies from pyproject.toml."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    table = text.split("[project]", 1)[1].split("\n[", 1)[0]
    extras_table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0] \
        if "[project.optional-dependencies]" in text else ""

    def field(key):
        m = re.search(rf'^{re.escape(key)}\s*=\s*"([^"]*)"', table, re.M)
        return m.group(1) if m else ""

    extras = {m.group(1): re.findall(r'"([^"]+)"', m.group(2))
              for m in re.finditer(r"^(\w+)\s*=\s*\[([^\]]*)\]", extras_table, re.M)}
    return {"name": field("name"), "version": field("version"), "description": field("description"),
            "requires_python": field("requires-python"), "extras": extras}


def _metadata(p):
    lines = ["Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}",
             f"Summary: {p['description']}"]
    if p["requires_python"]:
        lines.append(f"Requires-Python: {p['requires_python']}")
    for extra, deps in p["extras"].items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    readme = os.path.join(ROOT, "python", "README.md")
    lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + (open(readme).read() if os.path.exists(readme) else "")


def _tag():
    return "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


# ---- libepx.so ------------------------------------------------------------------------------------------------
def _runs(path):
    try:
        return subprocess.run([path, "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _pip_package_binary(script, name):
    """For a console script of the PyPI package `name` (cmake, ninja) in <env>/bin: the real binary the package
    ships in <env>/lib/python*/site-packages/<name>/data/bin, which runs without importing anything."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(script)))
    for site in sorted(glob.glob(os.path.join(root, "lib", "python*", "site-packages"))):
        binary = os.path.join(site, name, "data", "bin", name)
        if os.path.isfile(binary) and os.access(binary, os.X_OK):
            return binary
    return None


def _working_tool(name, override=None):
    """The first `name` on PATH whose `--version` succeeds (or $override if set), else None. A pip-installed
    console script that fails (pip's isolated build hides the module it imports) is replaced by the binary its
    package ships, when that runs."""
    explicit = os.environ.get(override) if override else None
    if explicit:
        return explicit
    seen = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which(name, path=directory or ".")
        if not candidate or os.path.realpath(candidate) in seen:
            continue
        seen.add(os.path.realpath(candidate))
        if _runs(candidate):
            return candidate
        binary = _pip_package_binary(candidate, name)
        if binary and _runs(binary):
            return binary
    return None


def _library():
    prebuilt = os.environ.get("EPX_PREBUILT_LIBRARY")
    if prebuilt:
        return prebuilt
    build_dir = os.environ.get("EPX_CMAKE_BUILD_DIR", os.path.join(ROOT, "build-python"))
    cmake = _working_tool("cmake", "EPX_CMAKE")
    if cmake is None:
        raise RuntimeError("epx: building libepx.so needs CMake >= 3.24 on PATH (none found that runs); "
                           "set EPX_CMAKE, or EPX_PREBUILT_LIBRARY to ship an existing libepx.so")
    configure = [cmake, "-S", ROOT, "-B", build_dir, "-DEPX_BUILD_TESTS=OFF", "-DEPX_BUILD_TOOLS=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"]
    # The generator can only be chosen when the folder is configured for the first time.
    ninja = _working_tool("ninja", "EPX_NINJA")
    if ninja and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    jobs = os.environ.get("EPX_BUILD_JOBS", str(os.cpu_count() or 1))
    subprocess.check_call(configure)
    subprocess.check_call([cmake, "--build", build_dir, "--target", "epx", "--parallel", jobs])
    return os.path.join(build_dir, "libepx.so")


# ---- wheel writing -------------------------------------------------------------------------------------------
class _Wheel:
    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records = []

    def add(self, arcname, data: bytes):
        self.zip.writestr(arcname, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append(f"{arcname},sha256={digest},{len(data)}")

    def close(self, dist_info):
        record = f"{dist_info}/RECORD"
        self.zip.writestr(record, "\n".join(self.records + [f"{record},,"]) + "\n")
        self.zip.close()


def _write_wheel(wheel_directory, files):
    p = _project()
    dist_info = f"{p['name']}-{p['version']}.dist-info"
    filename = f"{p['name']}-{p['version']}-{_tag()}.whl"
    wheel = _Wheel(os.path.join(wheel_directory, filename))
    for arcname, data in files:
        wheel.add(arcname, data)
    wheel.add(f"{dist_info}/METADATA", _metadata(p).encode())
    wheel.add(f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: epx_build\nRoot-Is-Purelib: false\n"
                                    f"Tag: {_tag()}\n".encode())
    wheel.add(f"{dist_info}/top_level.txt", b"epx\n")
    wheel.close(dist_info)
    return filename


def _package_files():
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE_DIR, name), "rb") as f:
                yield f"epx/{name}", f.read()


# ---- PEP 517 / 660 hooks ---------------------------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with open(_library(), "rb") as f:
        lib = f.read()
    return _write_wheel(wheel_directory, list(_package_files()) + [("epx/lib/libepx.so", lib)])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """A .pth that puts python/ on sys.path; the package then finds the library in build-python/."""
    _library()
    return _write_wheel(wheel_directory, [("epx_editable.pth", (os.path.join(ROOT, "python") + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = f"{p['name']}-{p['version']}"
    try:
        files = subprocess.check_output(["git", "ls-files"], cwd=ROOT, text=True).split()
    except (OSError, subprocess.CalledProcessError):
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, names in os.walk(ROOT)
                 for f in names if not os.path.relpath(d, ROOT).split(os.sep)[0].startswith(("build", ".git"))]
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            tar.add(os.path.join(ROOT, f), arcname=f"{base}/{f}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = _metadata(p).encode()
        info.size = len(data)
        import io
        tar.addfile(info, io.BytesIO(data))
    return os.path.basename(path)
