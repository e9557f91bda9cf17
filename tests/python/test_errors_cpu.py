"""Errors a person understands, on a CPU machine: epx.Buffer where torch cannot be imported, and creating a buffer
where there is no NVIDIA driver. Neither needs torch."""

import ctypes
import os
import subprocess
import sys

import pytest

import epx
from epx import _lib
from epx.bootstrap import AllGather

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter where 'import torch' fails (None in sys.modules), whether torch is installed or not.
_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
import epx
for name in ("Buffer", "EventOverlap", "topk_idx_t"):
    try:
        getattr(epx, name)
    except ModuleNotFoundError as e:
        print(name, "|", type(e).__name__, "|", e.name, "|", e)
    else:
        print(name, "| no error")
try:
    from epx import Buffer
except ImportError as e:
    print("from-import |", type(e).__name__, "|", e.name, "|", e)
# The ctypes-level API works without torch.
config = epx.Config(24, 6, 256)
print("size hint |", config.get_nvl_buffer_size_hint(7168 * 2, 8))
"""


def _run_without_torch():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" | ", 1) for line in out.stdout.splitlines())


def test_buffer_without_torch_says_what_is_missing_and_what_works():
    lines = _run_without_torch()
    for name in ("Buffer", "EventOverlap", "topk_idx_t", "from-import"):
        kind, module, message = lines[name].split(" | ", 2)
        assert kind == "ModuleNotFoundError" and module == "torch", lines[name]  # still an ImportError
        shown = "Buffer" if name == "from-import" else name
        assert f"epx.{shown} needs PyTorch" in message
        assert "-m pip install torch" in message and sys.executable in message
        assert "scripts/setup.sh" in message
        assert "ctypes-level API still works" in message and "epx.lib()" in message
    assert int(lines["size hint"]) > 0


def test_an_unrelated_missing_module_is_not_blamed_on_torch(monkeypatch):
    # Only torch's absence gets the torch message: another missing module stays what it was.
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "buffer" or name.endswith("epx.buffer"):
            raise ModuleNotFoundError("No module named 'somethingelse'", name="somethingelse")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.delitem(sys.modules, "epx.buffer", raising=False)
    with pytest.raises(ModuleNotFoundError) as info:
        epx.__getattr__("Buffer")
    assert info.value.name == "somethingelse"
    assert "PyTorch" not in str(info.value)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver (libcuda.so.1) is installed here")
def test_creating_a_buffer_without_a_driver_says_so():
    boot = AllGather(0, 1, lambda mine: [mine])
    options = _lib.BufferOptions(1 << 20, 0, 0, 0, 0.0, -1)
    out = ctypes.c_void_p(0x10)
    lib = epx.lib()
    status = lib.epx_buffer_create(ctypes.byref(boot.struct), ctypes.byref(options), ctypes.byref(out))
    with pytest.raises(epx.CudaError) as info:
        lib.check(status)
    message = str(info.value)
    assert "no NVIDIA GPU driver was found" in message
    assert "epx needs an NVIDIA GPU" in message
    assert "cudaErrorInsufficientDriver" in message  # the CUDA error's name stays, for searching
    assert not out.value
