"""The bootstrap of epx_buffer_create / destroy: "all-gather these bytes" over a torch.distributed group or
an mpi4py communicator, exposed to C as a ctypes callback.

The callback object must outlive the native buffer: destroy is collective and calls it again. An
exception inside a ctypes callback cannot cross into C, so it is caught, kept on the object (the Buffer
chains it to the EpxError it raises) and reported as a non-zero return.
"""

from __future__ import annotations

import collections
import ctypes
import time
import traceback
from typing import Any, Callable, Deque, List, Optional

from . import _lib

# The tensors of the last all-gathers over torch.distributed (all_gather_bytes), held by Python until the group's
# worker threads have surely dropped their references: see _hold.
_HELD: Deque[list] = collections.deque(maxlen=16)
_RELEASE_POLL_S = 0.02  # how long all_gather_bytes waits for a gloo worker thread to drop a CPU collective's work


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
    """The bootstrap over a gloo or NCCL group (all_gather_bytes); NCCL's tensors go on the buffer's device (a
    Buffer may be destroyed by the garbage collector while another device is current)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("epx.Buffer needs an initialized torch.distributed process group (or comm=MPI comm)")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")

    return AllGather(rank, size, lambda mine: all_gather_bytes(group, device, mine))


def _collective_device(group: Any) -> Any:
    """Where the group's collectives take their tensors: CUDA (the current device) for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    if pick is not None:
        return torch.device(pick(group))
    backend = str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _hold(tensors: list) -> None:
    """Keeps the collectives' tensors referenced from Python until the group's worker thread has dropped its work.

    A gloo worker thread drops a collective's work, and with it the last C++ references to the tensors, some time
    after wait() has returned (other backends keep the work on threads of their own too). If Python has let go of
    a tensor by then, that drop frees its Python object and needs the GIL; when the interpreter is already exiting
    (a Buffer destroyed just before the process ends, ranks pinned to one core each), Python ends the thread with
    pthread_exit inside C++ code and the process aborts ("terminate called without an active exception").
    torch.distributed.all_gather_object lets go of its tensors when it returns, so it is not used here.
    """
    if all(t.device.type == "cpu" for t in tensors) and hasattr(tensors[0], "_use_count"):
        deadline = time.monotonic() + _RELEASE_POLL_S
        while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
            time.sleep(0.0002)  # blocks, so that a worker thread sharing this core runs
    _HELD.append(tensors)  # pushed out 16 all-gathers later, long after any worker thread let go


def _to_bytes(t: Any) -> bytes:
    """A CPU uint8 tensor's bytes (no NumPy needed)."""
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def all_gather_bytes(group: Any, device: Optional[int], mine: bytes) -> List[bytes]:
    """Collective: every rank's bytes (lengths may differ), in rank order, over a torch.distributed group (None: the
    default group). device: the CUDA device an NCCL group's tensors go on (None: the current one)."""
    import contextlib

    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        dev = _collective_device(group)
        length = torch.tensor([len(mine)], dtype=torch.int64, device=dev)
        lengths = [torch.empty_like(length) for _ in range(size)]
        dist.all_gather(lengths, length, group=group)
        counts = [int(t.item()) for t in lengths]
        held = [length, *lengths]
        parts = [b""] * size
        width = max(counts)
        if width > 0:
            src = torch.zeros(width, dtype=torch.uint8)
            if mine:
                src[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            src = src.to(dev)
            outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(size)]
            dist.all_gather(outs, src, group=group)
            parts = [_to_bytes(out[:n].cpu()) for out, n in zip(outs, counts)]
            held += [src, *outs]
        _hold(held)
    return parts


def from_mpi_comm(comm: Any) -> AllGather:
    """An mpi4py communicator: comm.allgather pickles Python objects, bytes included."""
    rank = comm.Get_rank()
    size = comm.Get_size()
    return AllGather(rank, size, lambda mine: list(comm.allgather(mine)))
