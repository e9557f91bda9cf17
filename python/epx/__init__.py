"""epx: expert-parallel (MoE) dispatch and combine for PyTorch, over libepx's C ABI (ctypes, no compiled
extension). epx.Buffer follows deep_ep.Buffer's public API: `import epx as deep_ep` style ports only
change the import.

The torch-dependent names (Buffer, EventOverlap, topk_idx_t) are imported on first use, so that the
binding itself (epx.lib(), Config, the errors) works where torch is not installed; there, those names raise a
ModuleNotFoundError that says how to install torch.
"""

from __future__ import annotations

from ._lib import lib
from .config import Config
from .errors import (BootstrapError, BufferTooSmallError, CudaError, EpxError, FailedStateError, InternalError,
                     InvalidArgumentError, NotSupportedError, RemoteError, TimeoutError)

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Config", "EventOverlap", "topk_idx_t", "lib", "EpxError", "InvalidArgumentError",
    "BufferTooSmallError", "CudaError", "TimeoutError", "BootstrapError", "NotSupportedError", "FailedStateError",
    "InternalError", "RemoteError",
]


def _torch_missing(name: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for a torch-dependent name where torch cannot be imported: what is missing, how to get it, and
    what works without it. A ModuleNotFoundError (so an ImportError), as the bare one it replaces was."""
    import sys
    return ModuleNotFoundError(
        f"epx.{name} needs PyTorch, and 'import torch' failed in this Python ({sys.executable}): {error}. "
        f"Install it with `{sys.executable} -m pip install torch` (on Linux x86-64 the default wheel is a CUDA "
        "build), or, in epx's source checkout, run scripts/setup.sh, which sets up .venv with torch and pytest. "
        "Without torch, the ctypes-level API still works: epx.lib() (the C ABI), epx.Config, the errors, and the "
        "limits and size hints in epx._lib.", name="torch")


def __getattr__(name):
    if name in ("Buffer", "EventOverlap", "topk_idx_t"):
        try:
            if name == "Buffer":
                from .buffer import Buffer
                return Buffer
            if name == "EventOverlap":
                from .event import EventOverlap
                return EventOverlap
            import torch
            return torch.int64
        except ModuleNotFoundError as e:
            if e.name is None or (e.name != "torch" and not e.name.startswith("torch.")):
                raise
            raise _torch_missing(name, e) from e
    raise AttributeError(f"module 'epx' has no attribute {name!r}")
