"""epx: expert-parallel (MoE) dispatch and combine for PyTorch, over libepx's C ABI (ctypes, no compiled
extension). epx.Buffer follows deep_ep.Buffer's public API: `import epx as deep_ep` style ports only
change the import.

The torch-dependent names (Buffer, EventOverlap, topk_idx_t) are imported on first use, so that the
binding itself (epx.lib(), Config, the errors) works where torch is not installed.
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


def __getattr__(name):
    if name == "Buffer":
        from .buffer import Buffer
        return Buffer
    if name == "EventOverlap":
        from .event import EventOverlap
        return EventOverlap
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module 'epx' has no attribute {name!r}")
