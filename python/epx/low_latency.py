"""The low-latency methods of epx.Buffer (SPEC sections 4 and 5): no CPU sync, fixed-size outputs,
CUDA-graph capturable, send and receive phases separable through a hook.

Streams, as in deep_ep: with return_recv_hook the send phase runs on the current stream and the hook
later runs the receive phase on that same stream; otherwise the call runs on the communication stream
after it waited for the current one, and the current stream waits for it at the end unless async_finish
(then an EventOverlap is returned, holding the tensors the call uses until the caller is done with it).
"""

from __future__ import annotations

import ctypes
from ctypes import byref
from typing import Callable, Optional, Tuple

import torch

from . import _checks, _lib
from .event import EventOverlap

_FP8_GROUP = 128      # elements per FP8 scale
_UE8M0_PER_WORD = 4   # UE8M0 exponents packed per int32
_MAX_TOKENS = 4096    # largest num_max_dispatch_tokens_per_rank (kLowLatencyMaxTokens)
_MAX_EXPERTS = 1024   # largest num_experts (kLowLatencyMaxExperts)
_MAX_TOPK = 32


def _noop() -> None:
    return None


class _RecvHook:
    """Launches a receive phase when called. The launch closure holds the argument structs; `keep` holds the
    tensors the kernels read and write, so that none is freed before the receive phase is queued."""

    __slots__ = ("_launch", "_keep")

    def __init__(self, launch: Callable[[], int], keep: tuple):
        self._launch = launch
        self._keep = keep

    def __call__(self) -> None:
        _lib.lib().check(self._launch())


class _DeviceMemory:
    """Exposes library-owned device memory through __cuda_array_interface__ so that torch.as_tensor can
    wrap it without a copy. The resulting tensor references this object, which references the owner
    (the Buffer), so the memory outlives every view of it. bf16 has no typestr: it is exposed as int16."""

    def __init__(self, ptr: int, shape: Tuple[int, ...], owner):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (ptr, False), "strides": None,
                                         "version": 2}


class LowLatencyMixin:
    # ---- checks ---------------------------------------------------------------------------------------------
    def _ll_check_shape(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        R = self.group_size
        _checks.integer("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, _MAX_TOKENS)
        _checks.integer("hidden", hidden, 8)
        if hidden % 8 != 0:
            raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
        _checks.integer("num_experts", num_experts, 1, _MAX_EXPERTS)
        if num_experts % R != 0:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the number of ranks ({R})")

    def _ll_check_handle(self, handle):
        if not isinstance(handle, tuple) or len(handle) != 6 or not isinstance(handle[5], _lib.LLHandle):
            raise TypeError("handle must be the tuple returned by low_latency_dispatch (recv_src_info, "
                            "recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, native handle)")
        return handle

    # ---- buffer management -------------------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zeroes this rank's low-latency signals (both buffer sets), then a barrier, on the current
        stream. Needed after a failure, or before switching to other shapes."""
        self._ll_check_shape(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        need = self.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size,
                                                   num_experts)
        if need > self.num_rdma_bytes:
            from .errors import BufferTooSmallError
            raise BufferTooSmallError(f"clean_low_latency_buffer: num_rdma_bytes is {self.num_rdma_bytes} but these "
                                      f"shapes need {need} (get_low_latency_rdma_size_hint)", 2)
        ptr = self._ptr()
        lib = _lib.lib()
        lib.check(lib.epx_ll_clean(ptr, torch.cuda.current_stream(self._device).cuda_stream))

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The bf16 [L, R*M, H] area the next low_latency_combine(..., zero_copy=True) reads expert outputs
        from: write them there instead of into a tensor of your own, and skip one copy."""
        handle = self._ll_check_handle(handle)
        h: _lib.LLHandle = handle[5]
        ptr = self._ptr()
        out = ctypes.c_void_p()
        lib = _lib.lib()
        lib.check(lib.epx_ll_next_combine_buffer(ptr, byref(h), byref(out)))
        L = h.num_experts // self.group_size
        shape = (L, self.group_size * h.num_max_dispatch_tokens_per_rank, h.hidden)
        return torch.as_tensor(_DeviceMemory(out.value, shape, self), device=self._device).view(torch.bfloat16)

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """-> (recv_x, recv_count, handle, event, hook).

        recv_x: bf16 [L, R*M, H], or with use_fp8 (e4m3 [L, R*M, H], scales) where scales is a view of
        logical shape [L, R*M, H/128] float32 (UE8M0: [L, R*M, H/512] int32, 4 exponents per word) over
        token-minor storage. recv_count [L] int32: valid rows per local expert. handle: (recv_src_info
        [L, R*M] int32, recv_layout_range [L, R] int64, M, H, num_experts, native handle).
        dispatch_wait_recv_cost_stats is accepted and ignored (epx keeps no per-rank wait statistics).
        """
        R, d = self.group_size, self._device
        _checks.tensor("x", x, torch.bfloat16, (None, None), d, aligned16=True)
        T, H = x.shape
        self._ll_check_shape(num_max_dispatch_tokens_per_rank, H, num_experts)
        M, num_experts = int(num_max_dispatch_tokens_per_rank), int(num_experts)
        if T > M:
            raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank ({M})")
        _checks.tensor("topk_idx", topk_idx, torch.int64, (T, None), d)
        K = topk_idx.shape[1]
        _checks.integer("topk_idx.shape[1] (num_topk)", K, 1, _MAX_TOPK)
        L = num_experts // R
        _checks.optional_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                                torch.int32, (L,), d)
        use_fp8 = _checks.flag("use_fp8", use_fp8)
        round_scale = _checks.flag("round_scale", round_scale)
        use_ue8m0 = _checks.flag("use_ue8m0", use_ue8m0)
        if use_fp8 and H % _FP8_GROUP != 0:
            raise ValueError(f"use_fp8 needs hidden % {_FP8_GROUP} == 0, got {H}")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True")
        if use_ue8m0 and H % (_FP8_GROUP * _UE8M0_PER_WORD) != 0:
            raise ValueError(f"use_ue8m0 needs hidden % {_FP8_GROUP * _UE8M0_PER_WORD} == 0, got {H}")
        async_finish, return_recv_hook = self._ll_check_flags(async_finish, return_recv_hook)

        stream, compute = self._ll_begin(return_recv_hook)
        rows = R * M
        packed_recv_x = self._empty((L, rows, H), torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        scales_storage = None
        if use_ue8m0:
            scales_storage = self._empty((L, H // (_FP8_GROUP * _UE8M0_PER_WORD), rows), torch.int32)
        elif use_fp8:
            scales_storage = self._empty((L, H // _FP8_GROUP, rows), torch.float32)
        packed_recv_count = self._empty((L,), torch.int32)
        recv_src_info = self._empty((L, rows), torch.int32)
        recv_layout_range = self._empty((L, R), torch.int64)

        args = _lib.LLDispatchArgs(x.data_ptr(), T, H, topk_idx.data_ptr(), K, num_experts, M, int(use_fp8),
                                   int(round_scale), int(use_ue8m0),
                                   cumulative_local_expert_recv_stats.data_ptr()
                                   if cumulative_local_expert_recv_stats is not None else None)
        outs = _lib.LLDispatchOutputs(packed_recv_x.data_ptr(),
                                      scales_storage.data_ptr() if scales_storage is not None else None,
                                      packed_recv_count.data_ptr(), recv_src_info.data_ptr(),
                                      recv_layout_range.data_ptr())
        h = _lib.LLHandle()
        ptr = self._ptr()
        lib = _lib.lib()
        phases = _lib.EPX_LL_SEND if return_recv_hook else _lib.EPX_LL_BOTH
        lib.check(lib.epx_ll_dispatch(ptr, byref(args), byref(outs), phases, byref(h), stream.cuda_stream))

        tensors = (x, topk_idx, cumulative_local_expert_recv_stats, packed_recv_x, scales_storage, packed_recv_count,
                   recv_src_info, recv_layout_range)
        event = self._ll_end(stream, compute, async_finish, return_recv_hook, tensors)
        hook = _noop
        if return_recv_hook:
            hook = _RecvHook(lambda: lib.epx_ll_dispatch(self._ptr(), byref(args), byref(outs), _lib.EPX_LL_RECV,
                                                         byref(h), stream.cuda_stream), tensors)

        handle = (recv_src_info, recv_layout_range, M, H, num_experts, h)
        recv_x = packed_recv_x
        if scales_storage is not None:
            recv_x = (packed_recv_x, scales_storage.transpose(1, 2))  # logical [L, R*M, groups], token-minor
        return recv_x, packed_recv_count, handle, event, hook

    # ---- combine ------------------------------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """-> (combined_x [T, H] bf16, event, hook). combined_x[t] = bf16(sum over k ascending, slots with an
        expert, of w[t, k] * expert output row), float32 multiply then add. x: bf16 [L, R*M, H] in the packed
        layout of the dispatch (ignored with zero_copy, where the rows were written into
        get_next_low_latency_combine_buffer(handle)). combine_wait_recv_cost_stats is accepted and ignored.
        """
        if use_logfmt:
            raise NotImplementedError("low_latency_combine: use_logfmt (LogFMT-compressed combine) is not "
                                      "implemented by epx")
        R, d = self.group_size, self._device
        handle = self._ll_check_handle(handle)
        h: _lib.LLHandle = handle[5]
        M, H, E = handle[2], handle[3], handle[4]
        L = E // R
        _checks.tensor("x", x, torch.bfloat16, (L, R * M, H), d, aligned16=True)
        _checks.tensor("topk_idx", topk_idx, torch.int64, (h.num_tokens, h.num_topk), d)
        _checks.tensor("topk_weights", topk_weights, torch.float32, (h.num_tokens, h.num_topk), d)
        _checks.optional_tensor("out", out, torch.bfloat16, (h.num_tokens, H), d, aligned16=True)
        zero_copy = _checks.flag("zero_copy", zero_copy)
        async_finish, return_recv_hook = self._ll_check_flags(async_finish, return_recv_hook)

        stream, compute = self._ll_begin(return_recv_hook)
        combined_x = out if out is not None else self._empty((h.num_tokens, H), torch.bfloat16)
        args = _lib.LLCombineArgs(x.data_ptr(), int(zero_copy), topk_idx.data_ptr(), topk_weights.data_ptr())
        buffer_set = ctypes.c_int(-1)
        ptr = self._ptr()
        lib = _lib.lib()
        phases = _lib.EPX_LL_SEND if return_recv_hook else _lib.EPX_LL_BOTH
        lib.check(lib.epx_ll_combine(ptr, byref(args), byref(h), combined_x.data_ptr(), phases, byref(buffer_set),
                                     stream.cuda_stream))
        tensors = (x, topk_idx, topk_weights, handle[0], handle[1], combined_x)
        event = self._ll_end(stream, compute, async_finish, return_recv_hook, tensors)
        hook = _noop
        if return_recv_hook:
            hook = _RecvHook(lambda: lib.epx_ll_combine(self._ptr(), byref(args), byref(h), combined_x.data_ptr(),
                                                        _lib.EPX_LL_RECV, byref(buffer_set), stream.cuda_stream),
                             tensors)
        return combined_x, event, hook

    # ---- streams --------------------------------------------------------------------------------------------------
    @staticmethod
    def _ll_check_flags(async_finish, return_recv_hook) -> Tuple[bool, bool]:
        async_finish = _checks.flag("async_finish", async_finish)
        return_recv_hook = _checks.flag("return_recv_hook", return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (the hook runs the receive "
                             "phase on the current stream; there is nothing to wait for asynchronously)")
        return async_finish, return_recv_hook

    def _ll_begin(self, return_recv_hook: bool):
        """-> (launch stream, current stream). First step that touches CUDA."""
        self._ptr()
        compute = torch.cuda.current_stream(self._device)
        if return_recv_hook:
            return compute, compute
        self._comm_stream.wait_stream(compute)
        return self._comm_stream, compute

    @staticmethod
    def _ll_end(stream, compute, async_finish: bool, return_recv_hook: bool, tensors) -> EventOverlap:
        if async_finish:
            event = torch.cuda.Event()
            event.record(stream)
            return EventOverlap(event, tuple(t for t in tensors if t is not None))
        if not return_recv_hook:
            compute.wait_stream(stream)
        return EventOverlap()
