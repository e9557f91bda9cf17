"""The bootstrap of epx_buffer_create / destroy: "all-gather these bytes" over a torch.distributed group or
an mpi4py communicator, exposed to C as a ctypes callback.

The callback object must outlive the native buffer: destroy is collective and calls it again. An
exception inside a ctypes callback cannot cross into C, so it is caught, kept on the object (the Buffer
chains it to the EpxError it raises) and reported as a non-zero return.
"""

from __future__ import annotations

import ctypes
import traceback
from typing import Any, Callable, List, Optional

from . import _lib


class AllGather:
    """Owns the C callback and the epx_bootstrap struct that points to it."""

    def __init__(self, rank: int, size: int, gather: Callable[[bytes], List[bytes]]):
        self.rank = rank
        self.size = size
        self._gather = gather
        self.error: Optional[BaseException] = None
        self.error_text = ""
        self.callback = _lib.ALLGATHER_FN(self._call)  # kept here: C holds only the raw function pointer
        self.struct = _lib.Bootstrap(rank, size, self.callback, None)

    def _call(self, ctx, send, recv, nbytes) -> int:
        try:
            mine = ctypes.string_at(send, nbytes) if nbytes else b""
            parts = self._gather(mine)
            if len(parts) != self.size or any(len(p) != nbytes for p in parts):
                raise RuntimeError(f"all-gather returned {len(parts)} parts of sizes {[len(p) for p in parts]}, "
                                   f"expected {self.size} of {nbytes} bytes")
            ctypes.memmove(recv, b"".join(parts), nbytes * self.size)
            return 0
        except BaseException as e:  # noqa: BLE001 - nothing may escape into C
            self.error = e
            self.error_text = traceback.format_exc()
            return 1


def from_torch_group(group: Any, device: int) -> AllGather:
    """all_gather_object works for gloo and NCCL groups alike; NCCL needs the buffer's device to be current
    (a Buffer may be destroyed by the garbage collector while another device is current)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("epx.Buffer needs an initialized torch.distributed process group (or comm=MPI comm)")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")

    def gather(mine: bytes) -> List[bytes]:
        out: List[Any] = [None] * size
        with torch.cuda.device(device):
            dist.all_gather_object(out, mine, group=group)
        return out

    return AllGather(rank, size, gather)


def from_mpi_comm(comm: Any) -> AllGather:
    """An mpi4py communicator: comm.allgather pickles Python objects, bytes included."""
    rank = comm.Get_rank()
    size = comm.Get_size()
    return AllGather(rank, size, lambda mine: list(comm.allgather(mine)))
