"""ctypes binding of the C ABI (include/epx/epx.h): finding libepx.so, struct mirrors, function signatures.

Nothing here needs torch or a GPU: the CI tests load the library and exercise its error paths on a CPU.
Every struct below mirrors epx.h field for field (tests/python/test_ctypes.py compares sizes and offsets
with a C compiler's); pointers are c_void_p so that a tensor's data_ptr() (an int) can be stored directly.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, byref, c_char_p, c_double, c_int, c_int64, c_size_t,
                    c_void_p)

from .errors import error_for

# The ABI this package was written against (epx.h EPX_VERSION_MAJOR / MINOR).
ABI_MAJOR = 0
ABI_MIN_MINOR = 7  # 6: rank-reduced combine (topk_weights / recv_topk_slots, reduction) and rank masking
#                    (enable_shrink, shrink_timeout_s, epx_ll_*_mask); 7: the dispatch into the buffer
#                    (num_recv_bytes, epx_dispatch_in_buffer, epx_recv_region_size_hint) and the combine from it
#                    (epx_combine_region, epx_combine_in_buffer)

LIBRARY_NAME = "libepx.so"

# epx_status
EPX_OK = 0
# epx_dtype
EPX_BF16 = 0
EPX_FP8_E4M3 = 1
# regions of epx_buffer_region
EPX_REGION_NVL = 0
EPX_REGION_RDMA = 1
# low-latency phases
EPX_LL_SEND = 1
EPX_LL_RECV = 2
EPX_LL_BOTH = 3
# low-latency transports (epx_ll_transport_info.transport)
EPX_LL_TRANSPORT_NONE = 0
EPX_LL_TRANSPORT_CUDA_IPC = 1
EPX_LL_TRANSPORT_NVSHMEM = 2
# reduction orders of combine (epx_combine_args.reduction)
EPX_REDUCE_DEFAULT = 0
EPX_REDUCE_FLAT = 1
EPX_REDUCE_TWO_LEVEL = 2
EPX_REDUCE_RANK = 3  # low-latency combine only (epx_ll_combine_args.reduction)

# int (*)(void* ctx, const void* send, void* recv, size_t bytes)
ALLGATHER_FN = CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t)


class Bootstrap(Structure):
    _fields_ = [("rank", c_int), ("size", c_int), ("allgather", ALLGATHER_FN), ("ctx", c_void_p)]


class BufferOptions(Structure):
    _fields_ = [("num_nvl_bytes", c_int64), ("num_rdma_bytes", c_int64), ("low_latency_mode", c_int),
                ("num_nvl_ranks", c_int), ("timeout_s", c_double), ("device", c_int), ("force_internode", c_int),
                ("enable_shrink", c_int), ("shrink_timeout_s", c_double), ("num_recv_bytes", c_int64)]


class Limits(Structure):
    _fields_ = [("max_nvl_ranks", c_int), ("max_ranks", c_int), ("max_channels", c_int), ("max_topk", c_int),
                ("max_hidden", c_int), ("max_local_experts", c_int), ("max_experts", c_int),
                ("fp8_group_size", c_int), ("ll_max_ranks", c_int), ("ll_max_tokens", c_int),
                ("ll_max_experts", c_int), ("ll_max_topk", c_int)]


class Config(Structure):
    _fields_ = [("num_sms", c_int), ("num_max_send_tokens", c_int), ("num_max_recv_tokens", c_int),
                ("num_max_rdma_send_tokens", c_int), ("num_max_rdma_recv_tokens", c_int)]


class LayoutArgs(Structure):
    _fields_ = [("topk_idx", c_void_p), ("num_tokens", c_int), ("num_topk", c_int), ("num_experts", c_int)]


class LayoutOutputs(Structure):
    _fields_ = [("num_tokens_per_rank", c_void_p), ("num_tokens_per_rdma_rank", c_void_p),
                ("num_tokens_per_expert", c_void_p), ("is_token_in_rank", c_void_p)]


class DispatchArgs(Structure):
    _fields_ = [("x", c_void_p), ("dtype", c_int), ("num_tokens", c_int), ("hidden", c_int),
                ("x_scales", c_void_p), ("num_scales", c_int),
                ("x_scales_stride_token", c_int64), ("x_scales_stride_group", c_int64),
                ("topk_idx", c_void_p), ("topk_weights", c_void_p), ("num_topk", c_int), ("num_experts", c_int),
                ("num_tokens_per_rank", c_void_p), ("num_tokens_per_expert", c_void_p),
                ("is_token_in_rank", c_void_p), ("expert_alignment", c_int), ("num_worst_tokens", c_int)]


class DispatchHandle(Structure):
    _fields_ = [("num_ranks", c_int), ("num_channels", c_int), ("num_tokens", c_int), ("num_recv_tokens", c_int),
                ("rank_prefix_matrix", c_void_p), ("channel_prefix_matrix", c_void_p),
                ("recv_channel_prefix_matrix", c_void_p), ("recv_src_idx", c_void_p),
                ("is_token_in_rank", c_void_p), ("send_head", c_void_p),
                # internode buffers
                ("num_domains", c_int), ("num_nvl_ranks", c_int), ("num_rdma_recv_tokens", c_int),
                ("rdma_channel_prefix_matrix", c_void_p), ("recv_rdma_channel_prefix_matrix", c_void_p),
                ("recv_rdma_rank_prefix_sum", c_void_p), ("recv_gbl_rank_prefix_sum", c_void_p),
                ("recv_src_meta", c_void_p), ("send_rdma_head", c_void_p), ("send_nvl_head", c_void_p)]


class DispatchOutputs(Structure):
    _fields_ = [("recv_x", c_void_p), ("recv_x_scales", c_void_p), ("recv_topk_idx", c_void_p),
                ("recv_topk_weights", c_void_p), ("num_rows", c_int)]


class RecvRegion(Structure):
    _fields_ = [("recv_x", c_void_p), ("recv_x_scales", c_void_p), ("recv_topk_idx", c_void_p),
                ("recv_topk_weights", c_void_p), ("recv_src_idx", c_void_p), ("capacity", c_int)]


class DispatchCounts(Structure):
    # num_recv_tokens_per_expert is a host array owned by the library (valid until the next call).
    _fields_ = [("num_recv_tokens", c_int), ("num_rdma_recv_tokens", c_int), ("num_local_experts", c_int),
                ("num_recv_tokens_per_expert", POINTER(c_int))]


class CombineArgs(Structure):
    _fields_ = [("x", c_void_p), ("num_rows", c_int), ("hidden", c_int), ("topk_weights", c_void_p),
                ("num_topk", c_int), ("bias0", c_void_p), ("bias1", c_void_p), ("reduction", c_int)]


class CombineOutputs(Structure):
    _fields_ = [("combined_x", c_void_p), ("combined_topk_weights", c_void_p)]


class LLDispatchArgs(Structure):
    _fields_ = [("x", c_void_p), ("num_tokens", c_int), ("hidden", c_int), ("topk_idx", c_void_p),
                ("num_topk", c_int), ("num_experts", c_int), ("num_max_dispatch_tokens_per_rank", c_int),
                ("use_fp8", c_int), ("round_scale", c_int), ("use_ue8m0", c_int),
                ("cumulative_local_expert_recv_stats", c_void_p), ("topk_weights", c_void_p)]


class LLDispatchOutputs(Structure):
    _fields_ = [("packed_recv_x", c_void_p), ("packed_recv_x_scales", c_void_p), ("packed_recv_count", c_void_p),
                ("recv_src_info", c_void_p), ("recv_layout_range", c_void_p), ("recv_topk_slots", c_void_p)]


class LLHandle(Structure):
    _fields_ = [("buffer_set", c_int), ("num_tokens", c_int), ("hidden", c_int), ("num_topk", c_int),
                ("num_experts", c_int), ("num_max_dispatch_tokens_per_rank", c_int),
                ("recv_src_info", c_void_p), ("recv_layout_range", c_void_p), ("recv_topk_slots", c_void_p)]


class LLCombineArgs(Structure):
    _fields_ = [("x", c_void_p), ("zero_copy", c_int), ("topk_idx", c_void_p), ("topk_weights", c_void_p),
                ("use_logfmt", c_int), ("reduction", c_int)]


class LLTransportInfo(Structure):
    _fields_ = [("transport", c_int), ("num_peer_pointer_ranks", c_int), ("num_nvshmem_ranks", c_int)]


# Every struct of epx.h, by its C name (the ABI test compares each with the C compiler's layout).
STRUCTS = {
    "epx_bootstrap": Bootstrap, "epx_buffer_options": BufferOptions, "epx_limits": Limits, "epx_config": Config,
    "epx_layout_args": LayoutArgs, "epx_layout_outputs": LayoutOutputs, "epx_dispatch_args": DispatchArgs,
    "epx_dispatch_handle": DispatchHandle, "epx_dispatch_outputs": DispatchOutputs,
    "epx_dispatch_counts": DispatchCounts, "epx_combine_args": CombineArgs, "epx_combine_outputs": CombineOutputs,
    "epx_ll_dispatch_args": LLDispatchArgs, "epx_ll_dispatch_outputs": LLDispatchOutputs,
    "epx_ll_handle": LLHandle, "epx_ll_combine_args": LLCombineArgs, "epx_ll_transport_info": LLTransportInfo,
}

_P = POINTER
_buffer_p = c_void_p  # epx_buffer* is opaque
_stream = c_void_p    # cudaStream_t

# name: (restype, argtypes). Functions returning epx_status have restype c_int.
SIGNATURES = {
    "epx_last_error": (c_char_p, []),
    "epx_status_string": (c_char_p, [c_int]),
    "epx_version": (c_int, []),
    "epx_built_with_nvshmem": (c_int, []),
    "epx_buffer_create": (c_int, [_P(Bootstrap), _P(BufferOptions), _P(c_void_p)]),
    "epx_buffer_destroy": (c_int, [_buffer_p]),
    "epx_buffer_info": (c_int, [_buffer_p, _P(c_int), _P(c_int), _P(c_int), _P(c_int)]),
    "epx_buffer_is_internode": (c_int, [_buffer_p, _P(c_int)]),
    "epx_buffer_set_timeout": (c_int, [_buffer_p, c_double]),
    "epx_buffer_ll_transport": (c_int, [_buffer_p, _P(LLTransportInfo)]),
    "epx_buffer_check": (c_int, [_buffer_p, _stream]),
    "epx_buffer_region": (c_int, [_buffer_p, c_int, _P(c_void_p), _P(c_int64)]),
    "epx_get_limits": (c_int, [_P(Limits)]),
    "epx_config_num_channels": (c_int, [_P(Config), _P(c_int)]),
    "epx_default_dispatch_config": (c_int, [c_int, _P(Config)]),
    "epx_default_combine_config": (c_int, [c_int, _P(Config)]),
    "epx_config_nvl_size_hint": (c_int, [_P(Config), c_int64, c_int, _P(c_int64)]),
    "epx_config_internode_size_hints": (c_int, [_P(Config), c_int64, c_int, c_int, _P(c_int64), _P(c_int64)]),
    "epx_get_dispatch_layout": (c_int, [_buffer_p, _P(LayoutArgs), _P(LayoutOutputs), _stream]),
    "epx_notify_dispatch": (c_int, [_buffer_p, _P(DispatchArgs), _P(Config), _P(DispatchHandle),
                                    _P(DispatchCounts), _stream]),
    "epx_dispatch_sized": (c_int, [_buffer_p, _P(DispatchArgs), _P(Config), _P(DispatchHandle),
                                   _P(DispatchOutputs), _P(DispatchCounts), _stream]),
    "epx_dispatch": (c_int, [_buffer_p, _P(DispatchArgs), _P(Config), _P(DispatchHandle), _P(DispatchOutputs),
                             _stream]),
    "epx_dispatch_cached": (c_int, [_buffer_p, _P(DispatchArgs), _P(Config), _P(DispatchHandle),
                                    _P(DispatchOutputs), _stream]),
    "epx_combine": (c_int, [_buffer_p, _P(CombineArgs), _P(Config), _P(DispatchHandle), _P(CombineOutputs),
                            _stream]),
    "epx_dispatch_in_buffer": (c_int, [_buffer_p, _P(DispatchArgs), _P(Config), _P(DispatchHandle), c_int,
                                       _P(DispatchCounts), _P(RecvRegion), _stream]),
    "epx_recv_region_size_hint": (c_int, [c_int, c_int, c_int, c_int, c_int, _P(c_int64)]),
    "epx_combine_region": (c_int, [_buffer_p, c_int, c_int, _P(RecvRegion)]),
    "epx_combine_in_buffer": (c_int, [_buffer_p, _P(CombineArgs), _P(Config), _P(DispatchHandle),
                                      _P(CombineOutputs), _stream]),
    "epx_ll_size_hint": (c_int, [c_int, c_int, c_int, c_int, _P(c_int64)]),
    "epx_ll_clean": (c_int, [_buffer_p, _stream]),
    "epx_ll_dispatch": (c_int, [_buffer_p, _P(LLDispatchArgs), _P(LLDispatchOutputs), c_int, _P(LLHandle),
                                _stream]),
    "epx_ll_combine": (c_int, [_buffer_p, _P(LLCombineArgs), _P(LLHandle), c_void_p, c_int, _P(c_int), _stream]),
    "epx_ll_next_combine_buffer": (c_int, [_buffer_p, _P(LLHandle), _P(c_void_p)]),
    "epx_ll_update_mask": (c_int, [_buffer_p, c_int, c_int, _stream]),
    "epx_ll_query_mask": (c_int, [_buffer_p, c_void_p, _stream]),
    "epx_ll_clean_mask": (c_int, [_buffer_p, _stream]),
}


def candidate_paths() -> list:
    """Where libepx.so is looked for, in order: $EPX_LIBRARY; the package's lib/ (an installed wheel, or a
    copy placed in python/epx/lib/); then build trees of a source checkout (../../build*/ from this file),
    newest first, so that the tree the developer built last wins."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = []
    env = os.environ.get("EPX_LIBRARY")
    if env:
        paths.append(env)
    paths.append(os.path.join(here, "lib", LIBRARY_NAME))
    root = os.path.dirname(os.path.dirname(here))
    trees = glob.glob(os.path.join(root, "build*", LIBRARY_NAME))
    trees.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    paths.extend(trees)
    return paths


def _load_mode() -> int:
    """RTLD_DEEPBIND: libepx resolves its own dependencies (libstdc++, libgcc_s) before the process's globals.

    Seen on the GPU machines (Ubuntu, GCC 13 build of libepx): with torch imported first, the first C++
    exception thrown inside libepx (an argument error, caught inside libepx) crashed, because libepx bound the
    unwinder to another copy already in the process. EPX_DEEPBIND=0 turns this off.
    """
    mode = ctypes.RTLD_LOCAL
    if os.environ.get("EPX_DEEPBIND", "1") != "0":
        mode |= getattr(os, "RTLD_DEEPBIND", 0)
    return mode


class Library:
    """The loaded libepx.so with typed functions as attributes, plus `check(status)`."""

    def __init__(self, path: str):
        self.path = path
        self.dll = ctypes.CDLL(path, mode=_load_mode())
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self.dll, name)  # AttributeError names a symbol this build lacks
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        version = self.epx_version()
        self.version = (version // 100, version % 100)
        if self.version[0] != ABI_MAJOR or self.version[1] < ABI_MIN_MINOR:
            raise ImportError(f"{path} has C ABI version {self.version[0]}.{self.version[1]}; this package needs "
                              f"{ABI_MAJOR}.{ABI_MIN_MINOR} or a later {ABI_MAJOR}.x")

    def last_error(self) -> str:
        raw = self.epx_last_error()
        return raw.decode("utf-8", "replace") if raw else ""

    def status_string(self, status: int) -> str:
        raw = self.epx_status_string(status)
        return raw.decode("utf-8", "replace") if raw else ""

    def check(self, status: int) -> None:
        """Raises the EpxError subclass for a failed call. Must run on the thread that made the call
        (epx_last_error is thread-local), right after it."""
        if status != EPX_OK:
            message = self.last_error() or self.status_string(status)
            raise error_for(status, message)


_lock = threading.Lock()
_library = None


def lib() -> Library:
    """The process-wide Library, loaded on first use."""
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            tried = []
            for path in candidate_paths():
                if not os.path.isfile(path):
                    tried.append(f"{path} (missing)")
                    continue
                try:
                    _library = Library(path)
                    break
                except OSError as e:
                    tried.append(f"{path} ({e})")
            if _library is None:
                raise ImportError("could not load libepx.so; set EPX_LIBRARY to its path, install the package with "
                                  "`pip install .`, or build it with CMake. Tried: " + "; ".join(tried))
    return _library


# Small helpers for the C calls that only compute something on the host.

def default_config(kind: str, num_ranks: int) -> Config:
    out = Config()
    fn = lib().epx_default_dispatch_config if kind == "dispatch" else lib().epx_default_combine_config
    lib().check(fn(int(num_ranks), byref(out)))
    return out


_limits = None


def limits() -> Limits:
    """The library's limits (epx_get_limits), read once."""
    global _limits
    if _limits is None:
        out = Limits()
        lib().check(lib().epx_get_limits(byref(out)))
        _limits = out
    return _limits


def num_channels(config: Config) -> int:
    """Channels of the high-throughput kernels under a config (the per-channel handle arrays are [R, channels])."""
    out = c_int(0)
    lib().check(lib().epx_config_num_channels(byref(config), byref(out)))
    return out.value


def nvl_size_hint(config: Config, hidden_bytes: int, num_ranks: int) -> int:
    out = c_int64(0)
    lib().check(lib().epx_config_nvl_size_hint(byref(config), int(hidden_bytes), int(num_ranks), byref(out)))
    return out.value


def recv_region_size_hint(rows: int, hidden: int, dtype: int, num_scales: int, num_topk: int) -> int:
    out = c_int64(0)
    lib().check(lib().epx_recv_region_size_hint(int(rows), int(hidden), int(dtype), int(num_scales), int(num_topk),
                                                byref(out)))
    return out.value


def internode_size_hints(config: Config, hidden_bytes: int, num_ranks: int, num_nvl_ranks: int):
    """-> (num_nvl_bytes, num_rdma_bytes) the internode mode needs under a config, for rows of hidden_bytes, over
    num_ranks = D x num_nvl_ranks ranks (num_nvl_ranks 0: as many as one domain holds, at most 8)."""
    nvl, rdma = c_int64(0), c_int64(0)
    lib().check(lib().epx_config_internode_size_hints(byref(config), int(hidden_bytes), int(num_ranks),
                                                      int(num_nvl_ranks), byref(nvl), byref(rdma)))
    return nvl.value, rdma.value


def buffer_info(buffer: int):
    """-> (rank, num_ranks, device, num_nvl_ranks, internode) of a live buffer."""
    rank, num_ranks, device, num_nvl_ranks, internode = c_int(0), c_int(0), c_int(0), c_int(0), c_int(0)
    lib().check(lib().epx_buffer_info(buffer, byref(rank), byref(num_ranks), byref(device), byref(num_nvl_ranks)))
    lib().check(lib().epx_buffer_is_internode(buffer, byref(internode)))
    return rank.value, num_ranks.value, device.value, num_nvl_ranks.value, bool(internode.value)


def buffer_region(buffer: int, which: int):
    """-> (device pointer or None, bytes) of one region of a buffer's memory on this rank."""
    ptr, nbytes = c_void_p(), c_int64(0)
    lib().check(lib().epx_buffer_region(buffer, int(which), byref(ptr), byref(nbytes)))
    return ptr.value, nbytes.value


def ll_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    out = c_int64(0)
    lib().check(lib().epx_ll_size_hint(int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_ranks),
                                       int(num_experts), byref(out)))
    return out.value
