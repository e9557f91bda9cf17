"""The build backend (python/_build/epx_build.py) on a CPU: it packs the package and a libepx.so into a
wheel whose RECORD is right, and the unpacked wheel imports and loads its own library. The CMake step is
skipped by shipping the library the tests already use (EPX_PREBUILT_LIBRARY)."""

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile

import epx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _backend():
    spec = importlib.util.spec_from_file_location("epx_build", os.path.join(REPO, "python", "_build", "epx_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_contents_and_record(tmp_path, monkeypatch):
    monkeypatch.setenv("EPX_PREBUILT_LIBRARY", epx.lib().path)
    backend = _backend()
    assert backend.get_requires_for_build_wheel() == []
    name = backend.build_wheel(str(tmp_path))
    assert name.startswith("epx-") and name.endswith(".whl") and "-py3-none-" in name
    with zipfile.ZipFile(tmp_path / name) as whl:
        names = set(whl.namelist())
        assert {"epx/__init__.py", "epx/_lib.py", "epx/buffer.py", "epx/lib/libepx.so"} <= names
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
        record = whl.read(f"{dist_info}/RECORD").decode().splitlines()
        listed = {line.split(",")[0] for line in record}
        assert listed == names
        for line in record:
            path, digest, size = line.split(",")
            if path.endswith("RECORD"):
                continue
            data = whl.read(path)
            assert size == str(len(data))
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        metadata = whl.read(f"{dist_info}/METADATA").decode()
        assert "Name: epx" in metadata and "Requires-Dist: torch" in metadata
        wheel_meta = whl.read(f"{dist_info}/WHEEL").decode()
        assert "Root-Is-Purelib: false" in wheel_meta
        whl.extractall(tmp_path / "site")
    # The unpacked wheel loads the library it ships (not $EPX_LIBRARY, not a build tree).
    env = {k: v for k, v in os.environ.items() if k not in ("EPX_LIBRARY", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.check_output([sys.executable, "-c", "import epx; print(epx.lib().path)"], env=env, text=True,
                                  cwd=str(tmp_path))
    assert out.strip() == str(tmp_path / "site" / "epx" / "lib" / "libepx.so")


def test_editable_wheel_points_at_the_source_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("EPX_PREBUILT_LIBRARY", epx.lib().path)
    backend = _backend()
    name = backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as whl:
        pth = whl.read("epx_editable.pth").decode().strip()
    assert pth == os.path.join(REPO, "python")


def _script(directory, name, body):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_broken_tool_on_path_is_skipped(tmp_path, monkeypatch):
    # A virtual environment's pip-installed `cmake` is a Python script that fails under pip's build isolation;
    # the backend must use the next cmake on PATH that runs instead of failing the install.
    _script(tmp_path / "venv", "cmake", "echo 'ModuleNotFoundError: No module named cmake' >&2; exit 1")
    good = _script(tmp_path / "system", "cmake", "echo 'cmake version 3.31.0'")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "venv"), str(tmp_path / "system")]))
    monkeypatch.delenv("EPX_CMAKE", raising=False)
    backend = _backend()
    assert backend._working_tool("cmake", "EPX_CMAKE") == good
    assert backend._working_tool("ninja", "EPX_NINJA") is None  # none on this PATH
    monkeypatch.setenv("EPX_CMAKE", "/opt/my/cmake")
    assert backend._working_tool("cmake", "EPX_CMAKE") == "/opt/my/cmake"


def test_no_working_cmake_is_a_clear_error(tmp_path, monkeypatch):
    _script(tmp_path / "venv", "cmake", "exit 1")
    monkeypatch.setenv("PATH", str(tmp_path / "venv"))
    for var in ("EPX_CMAKE", "EPX_PREBUILT_LIBRARY"):
        monkeypatch.delenv(var, raising=False)
    backend = _backend()
    try:
        backend._library()
    except RuntimeError as e:
        assert "CMake" in str(e) and "EPX_CMAKE" in str(e)
    else:
        raise AssertionError("_library() built without a working cmake")


def test_a_pip_console_script_is_replaced_by_the_binary_its_package_ships(tmp_path, monkeypatch):
    # The GPU machines: the only cmake on PATH is the torch venv's console script (`from cmake import cmake`),
    # which fails under pip's build isolation; the cmake package ships the real binary in site-packages.
    script = _script(tmp_path / "venv" / "bin", "cmake", "exit 1")
    (tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "cmake" / "data").mkdir(parents=True)
    real = _script(tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "cmake" / "data" / "bin", "cmake",
                   "echo 'cmake version 3.31.0'")
    monkeypatch.setenv("PATH", os.path.dirname(script))
    monkeypatch.delenv("EPX_CMAKE", raising=False)
    assert _backend()._working_tool("cmake", "EPX_CMAKE") == real
