"""epx.Buffer: deep_ep.Buffer's public API over the C ABI. This file holds creation, lifetime, the queries, the
buffer tensors and the config helpers; the high-throughput methods are in high_throughput.py, the low-latency ones
in low_latency.py.

Each method checks its arguments first (nothing touches CUDA until they pass), then sets up the streams
(_streams.Streams), allocates the outputs with torch and calls the library with raw pointers.

The hot paths (cached dispatch, combine, and the low-latency calls) are written for host time: a handle's C
struct, its default configs and the argument structs of its last shapes are kept (only pointers change from call
to call), outputs are allocated with new_empty from per-dtype prototypes (cheaper to parse than torch.empty's
keywords), and async-only work is skipped on synchronous calls. A call that repeats the handle, config and flags
of the last call whose checks passed takes a short path that checks its tensors inline and skips only the checks
whose inputs are the same as then (the same handle tuple, plain ints of equal value, the same bool objects);
every tensor check (dtype, device, contiguity, shape, alignment) runs on every call, and whatever the short path
does not accept goes through every check, so errors are the same. Reusing structs is safe because a C call reads
them only while it runs, and the calls of one Buffer never overlap (they are collective, so every rank must issue
them in one order).
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from ctypes import byref
from typing import Optional, Tuple, Union

import torch

from . import _checks, _env, _lib
from ._memory import Views, itemsize
from ._streams import Streams
from .bootstrap import AllGather, from_mpi_comm, from_torch_group
from .config import Config
from .errors import FailedStateError, InternalError, error_for
from .event import EventOverlap
from .high_throughput import HighThroughputMixin
from .low_latency import LowLatencyMixin, output_reuse_env

_OUTPUT_DTYPES = (torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.bool, torch.float8_e4m3fn)


class _Native:
    """The epx_buffer* and the bootstrap callback it calls; separate from Buffer so that a finalizer can
    own it without keeping the Buffer alive."""

    def __init__(self, ptr: int, boot: AllGather):
        self.ptr = ptr
        self.boot = boot

    def destroy(self) -> None:
        if self.ptr is None:
            return
        ptr, self.ptr = self.ptr, None
        lib = _lib.lib()
        status = lib.epx_buffer_destroy(ptr)
        if status != _lib.EPX_OK:
            err = error_for(status, lib.last_error())
            raise err from self.boot.error

    def destroy_at_exit_or_gc(self) -> None:
        try:
            self.destroy()
        except Exception as e:  # noqa: BLE001 - a finalizer must not raise
            warnings.warn(f"epx.Buffer teardown failed: {e}", RuntimeWarning)

    def warn_if_alive(self) -> None:
        if self.ptr is not None:
            warnings.warn("an epx.Buffer created with explicitly_destroy=True was never destroyed "
                          "(call buffer.destroy() on every rank)", ResourceWarning)


class Buffer(HighThroughputMixin, LowLatencyMixin):
    """Communication buffer of one rank for MoE dispatch and combine, with deep_ep.Buffer's API.

    One Buffer per process (one process per GPU) and per group of ranks that exchange tokens. It holds:
    - the NVLink area (num_nvl_bytes): the rings of the high-throughput dispatch and combine inside one NVLink
      domain, mapped into every rank of the domain through CUDA IPC;
    - the RDMA area (num_rdma_bytes): the low-latency mode's send and receive slots, or in the internode mode the
      network rings between NVLink domains (NVSHMEM symmetric memory where libepx has NVSHMEM; the low-latency
      slots of a libepx without it are CUDA IPC memory).

    Modes. The library chooses the high-throughput mode at creation: the ranks that share a host form an NVLink
    domain ($EPX_NUM_NVL_RANKS=G sets the domain size instead); with one domain the intranode kernels run, with
    several (or with EPX_FORCE_INTERNODE=1) the internode (hierarchical) kernels, which need a libepx built with
    NVSHMEM. dispatch then returns deep_ep's internode handle (a 10-tuple) and combine sums in the two-level
    order by default. The low-latency methods work inside one NVLink domain and need low_latency_mode=True.

    Collective calls: creation, destroy, dispatch, combine, the low-latency calls and clean_low_latency_buffer.
    Every rank of the group must make them, in the same order; get_dispatch_layout and the queries are local.

    Attributes (read-only by convention): rank, group_size, group (the process group, or the mpi4py communicator
    when only comm was given), comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy,
    enable_shrink, low_latency_output_reuse (set by set_low_latency_output_reuse); the class attribute num_sms (set
    by set_num_sms; None: the library's default, 24).
    """

    # SMs of the high-throughput kernels, set by set_num_sms(); None means the library's default.
    num_sms: Optional[int] = None

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, num_recv_bytes: int = 0):
        """Collective: creates this rank's buffer and connects it with every other rank's.

        Every rank must call it with the same sizes and flags, each with its own GPU as the current CUDA device.
        The arguments, names, order and defaults are deep_ep.Buffer's, so positional calls mean the same thing.

        Arguments:
            group: the torch.distributed process group of the ranks that exchange tokens (gloo or NCCL: it only
                carries a few bytes at creation and destruction). May be None when comm is given; when both are
                given, group is used (as in deep_ep).
            num_nvl_bytes: int >= 0, default 0. Bytes of the NVLink area, which the high-throughput dispatch and
                combine need (size it with `Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden * 2,
                R)`, and the same for the combine config; take the larger). 0: no high-throughput calls.
            num_rdma_bytes: int >= 0, default 0. Bytes of the RDMA area: with low_latency_mode, the low-latency
                slots (get_low_latency_rdma_size_hint); in the internode mode, the network rings
                (Config.get_rdma_buffer_size_hint). 0 inside one NVLink domain without low-latency calls.
            low_latency_mode: bool, default False. Lays out the RDMA area for the low-latency calls
                (low_latency_dispatch / low_latency_combine).
            num_qps_per_rank: int >= 1, default 24. deep_ep's count of RDMA queue pairs per peer; checked for
                type and range, no effect here: epx sets up its transports (CUDA IPC, NVSHMEM) itself.
            allow_nvlink_for_low_latency_mode: bool, default True. No effect (checked for type): epx's low-latency
                mode runs inside one NVLink domain, whose ranks talk over NVLink.
            allow_mnnvl: bool, default False. deep_ep's multi-node NVLink switch; no effect (checked for type).
            use_fabric: bool, default False. deep_ep's allocation of its buffers through the CUDA fabric memory API
                (multi-node NVLink systems); no effect (checked for type): epx allocates its own memory (cudaMalloc
                shared through CUDA IPC inside a domain, NVSHMEM symmetric memory where it uses NVSHMEM).
            explicitly_destroy: bool, default False. True: you must call destroy() on every rank (a warning is
                issued if the Buffer is collected without it). False: the Buffer is destroyed when it is garbage
                collected or at interpreter exit; destruction is collective, so do not let one rank drop it early.
            enable_shrink: bool, default False. deep_ep's rank masking ("shrink" mode, semantics.md section 9): a
                low-latency wait for one rank that lasts longer than $EPX_LL_SHRINK_TIMEOUT_S seconds (default 1)
                masks that rank and the call completes without it; the low_latency_*_mask_buffer methods manage the
                mask. Needs num_rdma_bytes > 0 in a buffer over one NVLink domain, the same on every rank.
            comm: an mpi4py communicator (anything with Get_rank(), Get_size() and allgather(obj)), default None;
                used to exchange the set-up bytes when group is None.
            num_recv_bytes: int >= 0, default 0 (an epx addition, keyword only). Bytes of the output
                region that dispatch(..., outputs_in_buffer=True) writes its outputs into
                (get_recv_region_size_hint); the same on every rank, inside one NVLink domain only. 0: no such
                dispatch.

        Raises:
            TypeError / ValueError: an argument of the wrong type or out of range, or neither group nor comm;
                ValueError for $EPX_LL_OUTPUT_REUSE other than 0 or 1 (set_low_latency_output_reuse).
            RuntimeError: no CUDA device. epx.EpxError subclasses for failures of the library (BootstrapError
                when the exchange of set-up bytes fails, RemoteError when another rank failed).
        """
        num_nvl_bytes = _checks.integer("num_nvl_bytes", num_nvl_bytes, 0)
        num_rdma_bytes = _checks.integer("num_rdma_bytes", num_rdma_bytes, 0)
        low_latency_mode = _checks.flag("low_latency_mode", low_latency_mode)
        _checks.integer("num_qps_per_rank", num_qps_per_rank, 1)
        _checks.flag("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode)
        _checks.flag("allow_mnnvl", allow_mnnvl)
        _checks.flag("use_fabric", use_fabric)
        explicitly_destroy = _checks.flag("explicitly_destroy", explicitly_destroy)
        enable_shrink = _checks.flag("enable_shrink", enable_shrink)
        num_recv_bytes = _checks.integer("num_recv_bytes", num_recv_bytes, 0)
        output_reuse = output_reuse_env()
        if group is None and comm is None:
            raise ValueError("epx.Buffer needs group (a torch.distributed process group) or comm (an mpi4py comm)")
        if group is None:
            _check_comm(comm)
        if not torch.cuda.is_available():
            raise RuntimeError("epx.Buffer needs a CUDA device")
        device_index = torch.cuda.current_device()
        boot = from_torch_group(group, device_index) if group is not None else from_mpi_comm(comm)

        comm_stream = torch.cuda.Stream(device=device_index)
        lib = _lib.lib()
        # num_nvl_ranks 0 and force_internode 0: the library reads $EPX_NUM_NVL_RANKS, $EPX_FORCE_INTERNODE and
        # the hosts.
        # shrink_timeout_s 0: $EPX_LL_SHRINK_TIMEOUT_S, else the library's default (1 s).
        options = _lib.BufferOptions(num_nvl_bytes, num_rdma_bytes, int(low_latency_mode), 0, 0.0, device_index, 0,
                                     int(enable_shrink), 0.0, num_recv_bytes)
        out = ctypes.c_void_p()
        status = lib.epx_buffer_create(byref(boot.struct), byref(options), byref(out))
        if status != _lib.EPX_OK:
            raise error_for(status, lib.last_error()) from boot.error
        _, _, _, num_nvl_ranks, internode = _lib.buffer_info(out.value)
        self._init_state(_Native(out.value, boot), group, comm, boot.rank, boot.size,
                         torch.device("cuda", device_index), num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                         explicitly_destroy, num_nvl_ranks, internode, output_reuse)
        self._attach_streams(comm_stream)
        self.enable_shrink = enable_shrink
        self.num_recv_bytes = num_recv_bytes
        if explicitly_destroy:
            self._finalizer = weakref.finalize(self, self._native.warn_if_alive)
            self._finalizer.atexit = False
        else:
            self._finalizer = weakref.finalize(self, self._native.destroy_at_exit_or_gc)

    def _init_state(self, native, group, comm, rank, size, device, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                    explicitly_destroy, num_nvl_ranks, internode, output_reuse):
        self._native = native
        self.group = group if group is not None else comm  # deep_ep keeps the communicator there when no group
        self.comm = comm
        self.enable_shrink = False  # set by __init__ after this (rank masking, low_latency_*_mask_buffer)
        self.num_recv_bytes = 0     # likewise (the output region of dispatch(..., outputs_in_buffer=True))
        self.rank = rank
        self.group_size = size
        self._device = device
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._num_nvl_ranks = num_nvl_ranks  # G: ranks of one NVLink domain
        self._internode = internode          # the buffer runs the internode kernels
        self._default_configs = {}  # (kind, num_sms or None) -> epx_config of the default config
        self._configs = {}          # the field values of a Config passed in -> its epx_config
        self._last_handle = None    # _HandleCache of the last handle checked
        # The ring dispatch with a layout sizes its outputs by a guess from the rows of the last calls with the same
        # token count (high_throughput.py, _sized_rows), so its data kernel need not wait for the host.
        self._sized_dispatch = _env.switch("EPX_HT_SIZED_DISPATCH", True)
        self._recv_rows = {}        # token count -> rows received by the last few dispatches with a layout
        self._ll_dispatch_state = None  # low-latency dispatch: the last arguments that passed (low_latency.py)
        self._ll_combine_last = None    # low-latency combine: the last handle that passed, its x shape, the
        # reduction argument and its code
        self._ll_combine_structs = None  # low-latency combine: the argument structs calls without a hook share
        self.set_low_latency_output_reuse(output_reuse)  # the output pools of the low-latency calls (low_latency.py)
        self._views = Views()       # tensors handed out over this buffer's memory
        # Zero-size tensors whose new_empty allocates outputs of their dtype on the device.
        self._protos = {dtype: torch.empty(0, dtype=dtype, device=device) for dtype in _OUTPUT_DTYPES}

    def _attach_streams(self, comm_stream) -> None:
        self._comm_stream = comm_stream
        self._streams = Streams(comm_stream, self._device.index if self._device.index is not None else 0)

    @classmethod
    def _unlaunched(cls, group_size: int, rank: int = 0, device: Union[str, torch.device] = "cpu",
                    num_nvl_bytes: int = 1 << 20, num_rdma_bytes: int = 1 << 30, low_latency_mode: bool = True,
                    num_nvl_ranks: Optional[int] = None, internode: bool = False):
        """A Buffer with no native buffer behind it, whose tensors live on `device`: every argument check
        runs as usual, and the first step that would touch CUDA raises FailedStateError. For tests of the
        checks on machines without a GPU. num_nvl_ranks (default: every rank) and internode stand for what the
        library would have chosen."""
        self = cls.__new__(cls)
        self._init_state(None, None, None, rank, group_size, torch.device(device), num_nvl_bytes, num_rdma_bytes,
                         low_latency_mode, True, num_nvl_ranks if num_nvl_ranks is not None else group_size,
                         internode, output_reuse_env())
        self._comm_stream = None
        self._streams = None
        self._finalizer = None
        return self

    # ---- lifetime -------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Collective: frees this rank's buffer (every rank must call it, in the same order as its other
        collective calls). Needed with explicitly_destroy=True; allowed either way (deep_ep asserts that
        explicitly_destroy was set, epx does not). A second call does nothing. Tensors handed out by
        get_local_buffer_tensor or get_next_low_latency_combine_buffer must not be used afterwards (a warning
        is issued if one is still alive).

        Raises epx.EpxError subclasses when the library reports a failure (after the memory is released as far
        as possible; the Buffer is unusable afterwards either way).
        """
        if self._native is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        self._views.warn_if_alive("epx.Buffer.destroy")
        try:
            self._native.destroy()
        finally:
            self._native = None
            self._last_handle = None
            self._ll_dispatch_state = self._ll_combine_last = self._ll_combine_structs = None
            self._ll_drop_output_pools()

    def _ptr(self) -> int:
        native = self._native
        if native is None or native.ptr is None:
            raise FailedStateError("this epx.Buffer was destroyed (or never created)", 7)
        return native.ptr

    def is_available(self) -> bool:
        """True while the Buffer can run operations: created and not destroyed (deep_ep's
        runtime.is_available())."""
        native = self._native
        return native is not None and native.ptr is not None

    def set_timeout(self, seconds: float) -> None:
        """epx extension (local): the budget of every device and host wait of this Buffer's operations.

        Arguments:
            seconds: float > 0, the new budget (default at creation: 100 s). A wait that runs out fails its
                call with epx.TimeoutError (naming rank, role, channel and queue positions) instead of hanging.
        """
        lib = _lib.lib()
        lib.check(lib.epx_buffer_set_timeout(self._ptr(), float(seconds)))

    def check(self) -> None:
        """epx extension (local, synchronizing): waits for the current stream and the communication stream
        (low-latency calls with a receive hook run on the former), then raises any error a kernel of this
        Buffer recorded since the last check: epx.TimeoutError for a wait that ran out, or the error for invalid
        input found on the device (for example an expert id out of range). Returns None when there is none.
        """
        ptr = self._ptr()
        lib = _lib.lib()
        for stream in (torch.cuda.current_stream(self._device), self._comm_stream):
            lib.check(lib.epx_buffer_check(ptr, stream.cuda_stream))

    # ---- topology queries (local; deep_ep has them on its runtime object) -------------------------------------
    def is_internode_available(self) -> bool:
        """Returns True when this Buffer runs the internode (hierarchical) kernels: its ranks span several NVLink
        domains, or EPX_FORCE_INTERNODE=1 was set when it was created. False inside one domain."""
        return self._internode

    def get_num_rdma_ranks(self) -> int:
        """Returns the number of NVLink domains D = group_size / G (deep_ep's "RDMA ranks", its nodes): 1 when
        every rank is in one domain."""
        return self.group_size // self._num_nvl_ranks

    def get_rdma_rank(self) -> int:
        """Returns this rank's NVLink domain index in [0, D): rank // G, G being the domain size (ranks are
        numbered domain by domain). 0 inside one domain."""
        return self.rank // self._num_nvl_ranks

    def get_root_rdma_rank(self, global_: bool) -> int:
        """Returns the root of this rank's inter-domain group (the ranks with the same position in every domain),
        which is that group's member in domain 0.

        Arguments:
            global_: bool. True: the root's global rank, which is this rank's position in its domain
                (rank % G). False: the root's index inside the group, always 0.
        """
        return self.rank % self._num_nvl_ranks if _checks.flag("global_", global_) else 0

    def get_local_device_id(self) -> int:
        """Returns the index of the CUDA device this Buffer was created on (the current device at creation)."""
        return self._device.index

    def get_comm_stream(self) -> torch.cuda.Stream:
        """Returns the Buffer's communication stream (a torch.cuda.Stream on its device), on which dispatch,
        combine and the low-latency calls without a receive hook run.

        Once this has been called, every operation runs through that stream (the current-stream shortcut of
        synchronous calls is turned off), so that work you queue on it stays ordered with the operations.
        """
        self._streams.exposed = True  # the caller may queue work on it: every operation goes through it again
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A tensor over this rank's part of the Buffer's memory, without a copy (local).

        Arguments:
            dtype: torch.dtype of the tensor's elements.
            size: the tensor's shape: a torch.Size, a tuple of ints or an int; default None, the rest of the area
                from offset as a 1-D tensor. It must fit in the area.
            offset: int >= 0, default 0: where the tensor starts, in bytes from the start of the area; a
                multiple of dtype's size.
            use_rdma_buffer: bool, default False. False: the NVLink area (num_nvl_bytes); True: the RDMA area
                (num_rdma_bytes: the low-latency slots, or the internode mode's network rings).

        Returns:
            tensor: of dtype and size, on the Buffer's device, over that memory.

        The memory is the library's working space: the next operation of the area's mode (dispatch and combine
        for the NVLink area and the network rings, the low-latency calls for the low-latency slots) overwrites
        it, and writing into the low-latency slots clobbers their signals (call clean_low_latency_buffer before
        the next low-latency call). The tensor keeps the Buffer from being garbage-collected; destroy() frees
        the memory regardless and warns if such a tensor is still alive: do not use it after. A size that does
        not fit, a misaligned offset, or an area created with 0 bytes is a ValueError.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        offset = _checks.integer("offset", offset, 0)
        use_rdma_buffer = _checks.flag("use_rdma_buffer", use_rdma_buffer)
        shape = _shape_of(size)
        item = itemsize(dtype)
        which, area, name = (_lib.EPX_REGION_RDMA, "low-latency (RDMA) buffer", "num_rdma_bytes") if use_rdma_buffer \
            else (_lib.EPX_REGION_NVL, "NVLink buffer", "num_nvl_bytes")
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        if total == 0:
            raise ValueError(f"get_local_buffer_tensor: this Buffer has no {area} (it was created with {name}=0)")
        if offset % item != 0:
            raise ValueError(f"get_local_buffer_tensor: offset {offset} is not a multiple of the size of {dtype} "
                             f"({item} bytes)")
        if offset > total:
            raise ValueError(f"get_local_buffer_tensor: offset {offset} is past the end of the {area} ({total} bytes)")
        fit = (total - offset) // item
        numel = fit if shape is None else _numel(shape)
        if numel > fit:
            raise ValueError(f"get_local_buffer_tensor: size {list(shape)} of {dtype} needs {numel * item} bytes from "
                             f"offset {offset}, but the {area} has {total - offset} from there ({total} in all)")

        ptr, nbytes = _lib.buffer_region(self._ptr(), which)
        if nbytes != total:
            raise InternalError(f"get_local_buffer_tensor: the library reports {nbytes} bytes for the {area}, "
                                f"the Buffer was created with {total}", 8)
        return self._views.tensor(ptr + offset if numel else 0, numel * item, dtype, shape, self._device, self)

    # ---- static helpers ---------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Returns True: libepx is built for Hopper (sm_90) only. Its CMake build sets CMAKE_CUDA_ARCHITECTURES
        to 90-real and the kernels are written for that architecture; the C ABI has no architecture query, so
        this does not load the library."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs (thread blocks) the high-throughput kernels use by default, for every Buffer of the process:
        the num_sms of get_dispatch_config / get_combine_config and of the defaults of dispatch and combine.

        Arguments:
            new_num_sms: even int >= 2 (half the blocks send, half receive: new_num_sms / 2 channels). The
                library checks the upper bound (its channel limit) when a config is used.
        """
        _checks.integer("new_num_sms", new_num_sms, 2)
        if new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """Returns an EventOverlap holding a CUDA event just recorded on the current stream: pass it as
        previous_event to make an operation wait for the work queued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    @staticmethod
    def _library_config(kind: str, num_ranks: int) -> Config:
        """The library's default config of `kind` ("dispatch" or "combine"), with set_num_sms applied."""
        config = Config.from_c(_lib.default_config(kind, num_ranks))
        if Buffer.num_sms is not None:
            config.num_sms = Buffer.num_sms
        return config

    @staticmethod
    def get_recv_region_size_hint(num_rows: int, hidden: int, num_topk: int = 0, use_fp8: bool = False,
                                  num_scales: Optional[int] = None) -> int:
        """Returns the num_recv_bytes a Buffer needs for dispatch(..., outputs_in_buffer=True) to receive up to
        num_rows rows (at most the sum of all ranks' tokens) of this shape. A BF16 region of a hidden size also
        holds FP8 rows of that size with per-128 scales.

        Arguments:
            num_rows: int >= 0: the rows the region must hold.
            hidden: int: the row length (a multiple of 8 for BF16, 16 for FP8).
            num_topk: int in [0, 32], default 0: K of the dispatch's topk_idx (0: no top-k).
            use_fp8: bool, default False: FP8 rows with scales instead of BF16 rows.
            num_scales: int or None (default): FP8 scales per row, in [1, hidden]; None: hidden // 128 (at least
                1). Must be None or 0 for BF16.
        """
        use_fp8 = _checks.flag("use_fp8", use_fp8)
        num_rows = _checks.integer("num_rows", num_rows, 0)
        hidden = _checks.integer("hidden", hidden, 1)
        num_topk = _checks.integer("num_topk", num_topk, 0, 32)
        if num_scales is None:
            num_scales = max(1, hidden // 128) if use_fp8 else 0
        num_scales = _checks.integer("num_scales", num_scales, 0)
        return _lib.recv_region_size_hint(num_rows, hidden, _lib.EPX_FP8_E4M3 if use_fp8 else _lib.EPX_BF16,
                                          num_scales, num_topk)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Returns the library's recommended Config for dispatch over num_ranks ranks, with the num_sms of
        set_num_sms if it was called (else the library's default, 24).

        Arguments:
            num_ranks: int, the number of ranks of the group (any count the library supports, not only deep_ep's
                table of rank counts).
        """
        return Buffer._library_config("dispatch", num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Returns the library's recommended Config for combine over num_ranks ranks, with the num_sms of
        set_num_sms if it was called (else the library's default, 24).

        Arguments:
            num_ranks: int, the number of ranks of the group.
        """
        return Buffer._library_config("combine", num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Returns the num_rdma_bytes a low-latency Buffer needs for these shapes: both buffer sets (a dispatch
        and a combine may overlap), BF16 rows (which also cover FP8 with its scales).

        Arguments:
            num_max_dispatch_tokens_per_rank: int, M, the most tokens any rank dispatches in one call (the same
                on every rank).
            hidden: int, H, the hidden size (a multiple of 8).
            num_ranks: int, R, the number of ranks.
            num_experts: int, E, the number of experts over all ranks (a multiple of num_ranks).

        Raises epx.InvalidArgumentError for shapes the low-latency kernels do not support.
        """
        return _lib.ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


def _check_comm(comm) -> None:
    """comm must be usable as an mpi4py communicator by the bootstrap (bootstrap.from_mpi_comm)."""
    missing = [name for name in ("Get_rank", "Get_size", "allgather") if not callable(getattr(comm, name, None))]
    if missing:
        raise TypeError(f"comm must be an mpi4py communicator (with Get_rank, Get_size and allgather), got "
                        f"{type(comm).__name__} without {', '.join(missing)}")


def _shape_of(size) -> Optional[Tuple[int, ...]]:
    """get_local_buffer_tensor's size: None, an int, or a sequence of ints >= 0 (a torch.Size is one)."""
    if size is None:
        return None
    dims = (size,) if isinstance(size, int) and not isinstance(size, bool) else size
    if not isinstance(dims, (tuple, list, torch.Size)):
        raise TypeError(f"size must be a torch.Size, a tuple of ints or an int, got {type(size).__name__}")
    return tuple(_checks.integer(f"size[{i}]", d, 0) for i, d in enumerate(dims))


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
