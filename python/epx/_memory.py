"""Torch tensors over device memory the library owns (regions of a Buffer), without a copy.

The memory is exposed as bytes through __cuda_array_interface__ and wrapped with torch.as_tensor, then
viewed as the dtype asked for (the interface has no typestr for bf16 or FP8; bytes work for every dtype).
Lifetime: torch keeps the interface object alive as long as the tensor's storage, and the object holds
the Buffer, so a Buffer is never garbage-collected (which would free the memory) while a tensor over its
memory exists. An explicit Buffer.destroy() is collective and cannot wait for that: it frees the memory
anyway and warns when such tensors are still alive (Views.warn_if_alive).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Optional, Tuple

import torch


class _DeviceMemory:
    """nbytes of device memory at ptr, as a byte array; holds its owner."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


class Views:
    """The memory objects behind the tensors handed out for one Buffer (weakly: a tensor that is gone no
    longer counts)."""

    def __init__(self):
        self._alive = weakref.WeakSet()

    def tensor(self, ptr: int, nbytes: int, dtype: torch.dtype, shape: Optional[Tuple[int, ...]],
               device: torch.device, owner) -> torch.Tensor:
        """A tensor of dtype and shape (None: 1-D, as many elements as fit) over nbytes at ptr; nbytes must be
        a multiple of the dtype's size and ptr aligned to it."""
        if nbytes == 0:  # nothing to view: a plain empty tensor (no interface object for zero bytes)
            return torch.empty(shape if shape is not None else (0,), dtype=dtype, device=device)
        memory = _DeviceMemory(ptr, nbytes, owner)
        self._alive.add(memory)
        t = torch.as_tensor(memory, device=device).view(dtype)
        return t if shape is None else t.view(shape)

    def warn_if_alive(self, what: str) -> None:
        n = len(self._alive)
        if n:
            warnings.warn(f"{what}: {n} tensor(s) over this Buffer's memory (from get_local_buffer_tensor or "
                          f"get_next_low_latency_combine_buffer) are still alive; the memory is freed now, so they "
                          f"must not be used any more", RuntimeWarning, stacklevel=3)


def itemsize(dtype: torch.dtype) -> int:
    size = getattr(dtype, "itemsize", None)  # torch >= 2.1
    return size if size is not None else torch.empty(0, dtype=dtype).element_size()
