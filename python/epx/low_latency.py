"""The low-latency methods of epx.Buffer (semantics.md sections 4 and 5): no CPU sync, fixed-size outputs,
CUDA-graph capturable, send and receive phases separable through a hook.

Streams, as in deep_ep: with return_recv_hook the send phase runs on the current stream and the hook
later runs the receive phase on that same stream; otherwise the call runs on the communication stream
after it waited for the current one, and the current stream waits for it at the end unless async_finish
(then an EventOverlap is returned, holding the tensors the call uses until the caller is done with it).

Outputs: each call allocates its output tensors, as deep_ep does. Opt-in (set_low_latency_output_reuse,
$EPX_LL_OUTPUT_REUSE=1): they come from a small pool per Buffer (_output_pool.py) when a set the Buffer handed out
earlier is referenced by nothing else any more.
"""

from __future__ import annotations

import ctypes
from ctypes import byref
from typing import Callable, Optional, Tuple

import torch

from . import _checks, _env, _lib
from ._output_pool import AVAILABLE as _REUSE_AVAILABLE
from ._output_pool import OutputPool
from .event import EventOverlap

_FP8_GROUP = 128      # elements per FP8 scale
_UE8M0_PER_WORD = 4   # UE8M0 exponents packed per int32
_LOGFMT_GROUP = 128   # elements per LogFMT scale (use_logfmt)
# Names of the hot paths, looked up once (each torch.X or _lib.X costs an attribute lookup per use).
_BF16, _FP8, _FP32, _INT32, _INT64 = torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64
_SEND, _RECV, _BOTH = _lib.EPX_LL_SEND, _lib.EPX_LL_RECV, _lib.EPX_LL_BOTH
_REDUCE_FLAT, _REDUCE_RANK = _lib.EPX_REDUCE_FLAT, _lib.EPX_REDUCE_RANK
_Tensor, _LLHandle = torch.Tensor, _lib.LLHandle
# low_latency_combine's reduction argument -> epx_ll_combine_args.reduction
_LL_REDUCTIONS = {"flat": _REDUCE_FLAT, "rank": _REDUCE_RANK}


def _noop() -> None:
    return None


def output_reuse_env() -> bool:
    """$EPX_LL_OUTPUT_REUSE: 1 turns the reuse of low-latency output sets on for Buffers created afterwards; unset,
    empty or 0 leaves it off."""
    return _env.switch("EPX_LL_OUTPUT_REUSE", False)


class _RecvHook:
    """Launches a receive phase when called. The launch closure holds the argument structs; `keep` holds the
    tensors the kernels read and write, so that none is freed before the receive phase is queued."""

    __slots__ = ("_launch", "_keep")

    def __init__(self, launch: Callable[[], int], keep: tuple):
        self._launch = launch
        self._keep = keep

    def __call__(self) -> None:
        _lib.lib().check(self._launch())


class _LLDispatchState:
    """The scalar arguments of the last low_latency_dispatch whose checks passed, what follows from them, and the
    argument structs that calls without a hook share (a call reads them only while it runs, and the calls of a
    Buffer never overlap; a hook reads them again later, so a call with one gets its own). Only the pointer fields
    and num_tokens change from call to call; the optional pointers (stats, topk_weights, recv_topk_slots) are set
    by the calls that pass them and by the next call after one that did (extras)."""

    __slots__ = ("M", "E", "H", "K", "use_fp8", "round_scale", "use_ue8m0", "R", "L", "rows", "stats_shape", "x_proto",
                 "scale_proto", "scale_shape", "scale_strides", "i32_proto", "i64_proto", "args", "outs", "extras")

    def __init__(self, buffer, M: int, E: int, H: int, K: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool):
        self.M, self.E, self.H, self.K = M, E, H, K
        self.use_fp8, self.round_scale, self.use_ue8m0 = use_fp8, round_scale, use_ue8m0
        R = self.R = buffer.group_size
        L = self.L = E // R
        rows = self.rows = R * M
        self.stats_shape = (L,)
        protos = buffer._protos
        self.x_proto = protos[_FP8 if use_fp8 else _BF16]
        self.i32_proto, self.i64_proto = protos[_INT32], protos[_INT64]
        self.scale_proto = self.scale_shape = self.scale_strides = None
        if use_fp8:
            groups = H // (_FP8_GROUP * _UE8M0_PER_WORD) if use_ue8m0 else H // _FP8_GROUP
            self.scale_proto = protos[_INT32 if use_ue8m0 else _FP32]
            self.scale_shape, self.scale_strides = (L, rows, groups), (groups * rows, 1, rows)
        self.args = _lib.LLDispatchArgs(None, 0, H, None, K, E, M, use_fp8, round_scale, use_ue8m0, None)
        self.extras = False

    def allocate(self, with_slots: bool) -> tuple:
        """-> new outputs (packed_recv_x, scales or None, packed_recv_count, recv_src_info, recv_layout_range,
        topk_slots or None), each referenced by the tuple alone (what OutputPool.add measures)."""
        L, rows, i32 = self.L, self.rows, self.i32_proto
        # Scales: logical [L, R*M, groups], stored token-minor ([L, groups, R*M]); allocated with those strides
        # at once (one call instead of an allocation and a transpose). topk_slots: [R, M, K, 2] (packed row, weight
        # bits) per source token slot, what the rank-reduced combine sums with.
        return (self.x_proto.new_empty(L, rows, self.H),
                self.scale_proto.new_empty_strided(self.scale_shape, self.scale_strides) if self.use_fp8 else None,
                i32.new_empty(L), i32.new_empty(L, rows), self.i64_proto.new_empty(L, self.R),
                i32.new_empty(self.R, self.M, self.K, 2) if with_slots else None)


def _ll_dispatch_outputs_struct(outputs: tuple) -> _lib.LLDispatchOutputs:
    """The C struct naming the tensors of a dispatch output set (as _LLDispatchState.allocate returns them). It
    depends on the set alone: a set the output pool keeps carries its struct (OutputPool's `native`)."""
    packed_recv_x, scales, packed_recv_count, recv_src_info, recv_layout_range, topk_slots = outputs
    outs = _lib.LLDispatchOutputs()
    outs.packed_recv_x = packed_recv_x.data_ptr()
    if scales is not None:
        outs.packed_recv_x_scales = scales.data_ptr()
    outs.packed_recv_count = packed_recv_count.data_ptr()
    outs.recv_src_info = recv_src_info.data_ptr()
    outs.recv_layout_range = recv_layout_range.data_ptr()
    if topk_slots is not None:
        outs.recv_topk_slots = topk_slots.data_ptr()
    return outs


class LowLatencyMixin:
    _ll_shape_ok = None  # the (M, hidden, num_experts) that last passed _ll_check_shape
    # ---- checks ---------------------------------------------------------------------------------------------
    def _ll_check_shape(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Tuple[int, int]:
        """-> (num_max_dispatch_tokens_per_rank, num_experts) as ints. The last shape that passed is remembered:
        a decoding loop passes the same plain ints every call (hidden comes from a tensor's shape)."""
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if key == self._ll_shape_ok and type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int:
            return num_max_dispatch_tokens_per_rank, num_experts
        R = self.group_size
        M = _checks.integer("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1,
                            _lib.limits().ll_max_tokens)
        _checks.integer("hidden", hidden, 8)
        if hidden % 8 != 0:
            raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
        num_experts = _checks.integer("num_experts", num_experts, 1, _lib.limits().ll_max_experts)
        if num_experts % R != 0:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the number of ranks ({R})")
        if type(num_max_dispatch_tokens_per_rank) is int and type(hidden) is int and type(num_experts) is int:
            self._ll_shape_ok = key
        return M, num_experts

    def _ll_check_handle(self, handle):
        if not isinstance(handle, tuple) or len(handle) != 6 or not isinstance(handle[5], _lib.LLHandle):
            raise TypeError("handle must be the tuple returned by low_latency_dispatch (recv_src_info, "
                            "recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, native handle)")
        return handle

    # ---- output reuse -------------------------------------------------------------------------------------------
    def set_low_latency_output_reuse(self, enabled: bool) -> None:
        """epx extension (local): whether low_latency_dispatch and low_latency_combine hand out again output tensors
        of earlier calls that nothing references any more, instead of allocating new ones (off by default;
        $EPX_LL_OUTPUT_REUSE=1 at creation turns it on). Saves the host time of the allocations (about 1.6 us
        each on a GPU; the dispatch makes 4 to 6) and keeps up to 3 output sets per call kind allocated (at
        decoding shapes one dispatch set is hundreds of MB). Turning it off drops the kept sets. python/README.md
        says what "references" covers, and what it cannot see (record_stream: the reason it is not the default).

        Arguments:
            enabled: bool. Where this torch lacks the queries the checks need, reuse stays off.
        """
        enabled = _checks.flag("enabled", enabled) and _REUSE_AVAILABLE
        self.low_latency_output_reuse = enabled
        self._ll_dispatch_pool = OutputPool() if enabled else None
        self._ll_combine_pool = OutputPool() if enabled else None

    def get_low_latency_output_reuse_counts(self) -> dict:
        """epx extension (local, for debugging and benchmarks): -> {"dispatch": (reused, allocated, kept),
        "combine": (...)}: output sets handed out again and sets allocated since reuse was last turned on, and
        sets kept now; (0, 0, 0) while reuse is off."""
        return {name: pool.counts() if pool is not None else (0, 0, 0)
                for name, pool in (("dispatch", self._ll_dispatch_pool), ("combine", self._ll_combine_pool))}

    def _ll_drop_output_pools(self) -> None:
        for pool in (self._ll_dispatch_pool, self._ll_combine_pool):
            if pool is not None:
                pool.clear()

    # ---- buffer management -------------------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zeroes this rank's low-latency signals (both buffer sets), then a barrier of every rank, on
        the current stream. Needed after a failed call, after writing into the low-latency slots through
        get_local_buffer_tensor, or before switching to other shapes.

        Arguments:
            num_max_dispatch_tokens_per_rank: int M in [1, 4096], as the next low-latency calls will pass it.
            hidden: int H, a multiple of 8.
            num_experts: int E, a multiple of the number of ranks.
        The shapes must fit num_rdma_bytes (get_low_latency_rdma_size_hint), else epx.BufferTooSmallError.
        """
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
        """Returns the area the next low_latency_combine(..., zero_copy=True) of this handle reads the expert
        outputs from (local): write them there instead of into a tensor of your own, and skip one copy.

        Arguments:
            handle: the handle returned by low_latency_dispatch.

        Returns:
            buffer: bf16 [L, R*M, H] tensor over the Buffer's memory (L = E / R local experts, M the dispatch's
                num_max_dispatch_tokens_per_rank), in the packed layout of the dispatch's recv_x. The next
                low-latency calls reuse the memory; destroy() warns if the tensor is still alive.
        """
        handle = self._ll_check_handle(handle)
        h: _lib.LLHandle = handle[5]
        ptr = self._ptr()
        out = ctypes.c_void_p()
        lib = _lib.lib()
        lib.check(lib.epx_ll_next_combine_buffer(ptr, byref(h), byref(out)))
        L = h.num_experts // self.group_size
        shape = (L, self.group_size * h.num_max_dispatch_tokens_per_rank, h.hidden)
        return self._views.tensor(out.value, shape[0] * shape[1] * shape[2] * 2, torch.bfloat16, shape, self._device,
                                  self)

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *, topk_weights: Optional[torch.Tensor] = None):
        """Collective: sends each token to the experts it selected, for decoding (semantics.md section 4): no CPU sync,
        outputs of fixed size, capturable in a CUDA graph, and send and receive phases separable through a hook.
        Needs a Buffer created with low_latency_mode=True inside one NVLink domain.

        Arguments:
            x: bf16 [T, H] on the Buffer's device, 16-byte aligned, T <= num_max_dispatch_tokens_per_rank (T may
                be 0), H a multiple of 8 (of 128 with use_fp8, of 512 with use_ue8m0).
            topk_idx: int64 [T, K] (epx.topk_idx_t), K in [1, 32]: each token's experts, -1 for none.
            num_max_dispatch_tokens_per_rank: int M in [1, 4096], the same on every rank and in every call that
                shares these buffers (see get_low_latency_rdma_size_hint).
            num_experts: int E, a multiple of the number of ranks R; L = E / R experts live on each rank.
            cumulative_local_expert_recv_stats: int32 [L] or None (default): if given, the tokens each local
                expert receives are added to it (statistics for load balancing).
            dispatch_wait_recv_cost_stats: accepted and ignored, default None (deep_ep's per-rank wait times;
                epx keeps no such statistics).
            use_fp8: bool, default True: the tokens travel and arrive as FP8 e4m3 with one float32 scale per
                128 elements (scale = amax / 448).
            round_scale: bool, default False: round each scale up to a power of two.
            use_ue8m0: bool, default False: scales as 8-bit exponents, 4 packed per int32 (needs use_fp8 and
                round_scale).
            async_finish: bool, default False. False: the results are ready on the current stream when the call
                returns. True: the call runs on the communication stream and the current stream does not wait;
                wait on the returned event. Not with return_recv_hook.
            return_recv_hook: bool, default False. True: the call only sends (on the current stream) and returns
                a hook; calling the hook queues the receive phase on that same stream, after which the outputs
                are ready. Lets the caller overlap other work with the transfer.
            topk_weights: keyword-only epx extension, float32 [T, K] or None (default). Given, each token's top-k
                weights travel with it (a few bytes per token and rank), so that low_latency_combine of this handle
                can use reduction="rank" (semantics.md section 5), which sums with these weights.

        Returns:
            recv_x: with use_fp8, a tuple (data float8_e4m3fn [L, R*M, H], scales): scales float32 [L, R*M, H/128]
                (use_ue8m0: int32 [L, R*M, H/512]), a strided view stored token-minor (each expert's rows of one
                scale column are contiguous, as grouped GEMMs read them). Without use_fp8, bf16 [L, R*M, H].
                Expert i's tokens are grouped by source rank, each group in source token order; only the first
                recv_count[i] rows of expert i are valid.
            recv_count: int32 [L], the valid rows of each local expert.
            handle: for low_latency_combine and get_next_low_latency_combine_buffer: (recv_src_info [L, R*M]
                int32 (source token index of each row), recv_layout_range [L, R] int64 ((first row << 32) | count
                per source rank), M, H, num_experts, the library's handle) (deep_ep's 5 elements plus one).
            event: EventOverlap, holding an event only with async_finish.
            hook: a callable taking no arguments; with return_recv_hook it runs the receive phase, else it does
                nothing.
        The output tensors may be ones an earlier call returned that nothing references any more
        (set_low_latency_output_reuse).
        """
        d = self._device
        stats = cumulative_local_expert_recv_stats
        s = self._ll_dispatch_state
        # The common call repeats the scalar arguments of the last call whose checks passed (plain ints, the same
        # bool objects, x and topk_idx of the same hidden and num_topk): those checks are not repeated, the tensor
        # checks are, in the same order. Anything else, or a tensor the short test below does not pass, goes
        # through every check (_ll_dispatch_checks), which raises the error that says what is wrong.
        T = -1
        if s is not None and use_fp8 is s.use_fp8 and round_scale is s.round_scale and use_ue8m0 is s.use_ue8m0 \
                and type(num_max_dispatch_tokens_per_rank) is int and num_max_dispatch_tokens_per_rank == s.M \
                and type(num_experts) is int and num_experts == s.E \
                and isinstance(x, _Tensor) and x.dtype is _BF16 and x.device == d and x.is_contiguous() \
                and isinstance(topk_idx, _Tensor) and topk_idx.dtype is _INT64 and topk_idx.device == d \
                and topk_idx.is_contiguous():
            xs, ks = x.shape, topk_idx.shape
            if len(xs) == 2 and len(ks) == 2 and xs[1] == s.H and ks[1] == s.K and ks[0] == xs[0] <= s.M \
                    and not x.data_ptr() & 15:
                T = xs[0]
                if stats is not None:
                    _checks.tensor("cumulative_local_expert_recv_stats", stats, _INT32, s.stats_shape, d)
                if topk_weights is not None:
                    _checks.tensor("topk_weights", topk_weights, _FP32, (T, s.K), d)
        if T < 0:
            s, T = self._ll_dispatch_checks(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats,
                                            topk_weights, use_fp8, round_scale, use_ue8m0)
        if async_finish is not False or return_recv_hook is not False:  # both False: nothing to check
            async_finish, return_recv_hook = self._ll_check_flags(async_finish, return_recv_hook)

        native = self._native
        ptr = native.ptr if native is not None else None
        if ptr is None:
            ptr = self._ptr()  # raises
        stream, compute = self._ll_begin(return_recv_hook, async_finish)
        H, K, M = s.H, s.K, s.M
        with_slots = topk_weights is not None
        pool = self._ll_dispatch_pool
        kept = None  # the pool's entry of the output set, which carries the set's C struct
        if pool is not None:
            # Outputs are allocated on the current stream: the launch stream, or the one comm waited for.
            kept = pool.take((s, with_slots), stream if compute is None else self._streams.compute_raw)
            if kept is not None:
                outputs = kept.outputs
            else:
                outputs = s.allocate(with_slots)
                kept = pool.add(outputs)
        else:
            outputs = s.allocate(with_slots)
        packed_recv_x, scales, packed_recv_count, recv_src_info, recv_layout_range, topk_slots = outputs
        # The pool hands a set out again only with every data pointer unchanged, so the struct made for the set
        # still names its tensors.
        outs = kept.native if kept is not None else None
        if outs is None:
            outs = _ll_dispatch_outputs_struct(outputs)
            if kept is not None:
                kept.native = outs

        if return_recv_hook:  # the hook reads its args again later: its own
            args = _lib.LLDispatchArgs(None, T, H, None, K, s.E, M, s.use_fp8, s.round_scale, s.use_ue8m0, None)
            extras = True
        else:
            args = s.args
            args.num_tokens = T
            # The optional pointers are all None in the shared args unless a call set them.
            extras = stats is not None or topk_weights is not None or s.extras
            s.extras = stats is not None or topk_weights is not None
        args.x = x.data_ptr()
        args.topk_idx = topk_idx.data_ptr()
        if extras:
            args.cumulative_local_expert_recv_stats = stats.data_ptr() if stats is not None else None
            args.topk_weights = topk_weights.data_ptr() if topk_slots is not None else None
        h = _LLHandle()
        if topk_slots is not None:
            h.topk_slots = topk_slots  # alive as long as the handle: the combine reads it
        lib = _lib._library if _lib._library is not None else _lib.lib()
        # The structs themselves, not byref(): ctypes converts them to pointers faster (POINTER argtypes).
        status = lib.epx_ll_dispatch(ptr, args, outs, _SEND if return_recv_hook else _BOTH, h, stream)
        if status:
            lib.check(status)

        if async_finish or return_recv_hook:
            tensors = (x, topk_idx, stats, packed_recv_x, scales, packed_recv_count, recv_src_info,
                       recv_layout_range, topk_weights, topk_slots)
            if return_recv_hook:
                hook = _RecvHook(lambda: lib.epx_ll_dispatch(self._ptr(), args, outs, _RECV, h, stream), tensors)
                event = EventOverlap()
            else:
                hook = _noop
                event = self._streams.end_async_keep(tensors)
        else:
            hook = _noop
            event = EventOverlap() if compute is None else self._streams.end_sync(compute)

        handle = (recv_src_info, recv_layout_range, M, H, s.E, h)
        if scales is not None:
            return (packed_recv_x, scales), packed_recv_count, handle, event, hook
        return packed_recv_x, packed_recv_count, handle, event, hook

    # ---- combine ------------------------------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, *,
                            reduction: Optional[str] = None):
        """Collective: sends the experts' outputs back to the tokens' ranks and sums them with the top-k weights
        (semantics.md section 5): combined_x[t] = bf16(sum over k ascending, slots with an expert, of topk_weights[t, k] *
        expert output row), float32 multiplies and adds, rounded once. No CPU sync, capturable in a CUDA graph.
        With use_logfmt the rows travel compressed and each is decoded to float32 before that same sum.

        Arguments:
            x: bf16 [L, R*M, H], 16-byte aligned: the expert outputs in the packed layout of the dispatch's
                recv_x (only the valid rows are read). Checked but not read with zero_copy.
            topk_idx: int64 [T, K], the topk_idx given to the low_latency_dispatch of handle.
            topk_weights: float32 [T, K], the weights to sum with.
            handle: the handle returned by that low_latency_dispatch.
            use_logfmt: bool, default False. True: every expert output row travels as LogFMT (semantics.md section 9,
                docs/logfmt.md): per 128 elements a 16-bit scale (the group's largest level) and 10 bits a value
                (sign and log2|x| in steps of 1/64 over 8 octaves below it), 63% of the BF16 bytes; rows are decoded
                to float32 before the sum, so the result differs from the BF16 one (within 1e-5 by 1 - 2*sum(x*y)
                / sum(x*x + y*y) on random normal data), bit for bit the same on every run. Needs H % 128 == 0.
                With zero_copy, the combine buffer's contents are unspecified afterwards.
            zero_copy: bool, default False. True: the outputs were already written into
                get_next_low_latency_combine_buffer(handle), and x is not read.
            async_finish: bool, default False. False: the result is ready on the current stream when the call
                returns. True: the call runs on the communication stream and the current stream does not wait;
                wait on the returned event. Not with return_recv_hook.
            return_recv_hook: bool, default False. True: the call only sends (on the current stream) and returns
                a hook; calling the hook queues the receive phase (and the sum) on that same stream.
            out: bf16 [T, H] or None (default): if given, the result is written into it and it is returned. It must
                not overlap x (refused: the kernel reads x while it writes out).
            combine_wait_recv_cost_stats: accepted and ignored, default None (deep_ep's per-rank wait times).
            reduction: keyword-only epx extension (semantics.md section 5), None (default) or "flat": the sum above.
                "rank": each rank holding experts of a token first sums their rows (k ascending, float32, with the
                topk_weights given to the dispatch) and rounds the partial to bf16; one row per (token, rank)
                travels back (about 1 / (experts hit per rank) of the flat bytes) and combined_x[t] = bf16(sum over
                ranks ascending of the partials). Needs a handle from low_latency_dispatch(..., topk_weights=...);
                topk_weights here are then checked but not read. Not with use_logfmt.

        Returns:
            combined_x: bf16 [T, H] (out if given; else possibly a tensor an earlier call returned that nothing
                references any more, see set_low_latency_output_reuse).
            event: EventOverlap, holding an event only with async_finish.
            hook: a callable taking no arguments; with return_recv_hook it runs the receive phase, else it does
                nothing.
        """
        d = self._device
        c = self._ll_combine_last
        # The common call: the handle of the last call whose checks passed (the same tuple: its parts were checked
        # then; the native handle's counts are read again) with the same reduction argument (None or the same str,
        # c[2]; its code c[3] was checked with that handle), without LogFMT. Every tensor check is repeated, in the
        # same order. Anything else, or a tensor the short test here does not pass, goes through every check
        # (_ll_combine_checks), which raises the error that says what is wrong.
        T = -1
        if c is not None and c[0] is handle and (reduction is c[2] or (type(reduction) is str and reduction == c[2])) \
                and use_logfmt is False \
                and (zero_copy is False or zero_copy is True):
            h = handle[5]
            tk = (h.num_tokens, h.num_topk)
            if isinstance(x, _Tensor) and x.dtype is _BF16 and x.device == d and x.is_contiguous() \
                    and x.shape == c[1] and not x.data_ptr() & 15 \
                    and isinstance(topk_idx, _Tensor) and topk_idx.dtype is _INT64 and topk_idx.device == d \
                    and topk_idx.is_contiguous() and topk_idx.shape == tk \
                    and isinstance(topk_weights, _Tensor) and topk_weights.dtype is _FP32 \
                    and topk_weights.device == d and topk_weights.is_contiguous() and topk_weights.shape == tk:
                T, H, code = tk[0], handle[3], c[3]
                if out is not None:
                    _checks.tensor("out", out, _BF16, (T, H), d, aligned16=True)
        if T < 0:
            h, T, H, zero_copy, use_logfmt, code = self._ll_combine_checks(x, topk_idx, topk_weights, handle,
                                                                          use_logfmt, zero_copy, out, reduction)
        if async_finish is not False or return_recv_hook is not False:  # both False: nothing to check
            async_finish, return_recv_hook = self._ll_check_flags(async_finish, return_recv_hook)

        native = self._native
        ptr = native.ptr if native is not None else None
        if ptr is None:
            ptr = self._ptr()  # raises
        stream, compute = self._ll_begin(return_recv_hook, async_finish)
        if out is not None:
            combined_x = out
        else:
            pool = self._ll_combine_pool
            kept = None
            if pool is not None:
                kept = pool.take((T, H), stream if compute is None else self._streams.compute_raw)
            if kept is not None:
                combined_x, = kept.outputs
            else:
                outputs = (self._protos[_BF16].new_empty(T, H),)
                if pool is not None:
                    pool.add(outputs)
                combined_x, = outputs
        if return_recv_hook:  # the hook reads its structs again later: its own
            args, buffer_set = _lib.LLCombineArgs(), ctypes.c_int(-1)
        else:
            structs = self._ll_combine_structs
            if structs is None:
                structs = self._ll_combine_structs = (_lib.LLCombineArgs(), ctypes.c_int(-1))
            args, buffer_set = structs
        args.x = x.data_ptr()
        args.zero_copy = zero_copy
        args.use_logfmt = use_logfmt
        args.reduction = code
        args.topk_idx = topk_idx.data_ptr()
        args.topk_weights = topk_weights.data_ptr()
        lib = _lib.lib()
        combined_ptr = combined_x.data_ptr()
        status = lib.epx_ll_combine(ptr, args, h, combined_ptr, _SEND if return_recv_hook else _BOTH, buffer_set,
                                    stream)
        if status:
            lib.check(status)
        if async_finish or return_recv_hook:
            tensors = (x, topk_idx, topk_weights, handle[0], handle[1], combined_x, getattr(h, "topk_slots", None))
            if return_recv_hook:
                hook = _RecvHook(lambda: lib.epx_ll_combine(self._ptr(), args, h, combined_ptr, _RECV, buffer_set,
                                                            stream), tensors)
                return combined_x, EventOverlap(), hook
            return combined_x, self._streams.end_async_keep(tensors), _noop
        return combined_x, EventOverlap() if compute is None else self._streams.end_sync(compute), _noop

    def _ll_combine_checks(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, reduction):
        """Every check of low_latency_combine but those of async_finish and return_recv_hook, in order. -> (native
        handle, T, H, zero_copy, use_logfmt, reduction code)."""
        R, d = self.group_size, self._device
        handle = self._ll_check_handle(handle)
        h: _lib.LLHandle = handle[5]
        M, H, E = handle[2], handle[3], handle[4]
        T, K = h.num_tokens, h.num_topk
        x_shape = (E // R, R * M, H)
        _checks.tensor("x", x, _BF16, x_shape, d, aligned16=True)
        _checks.tensor("topk_idx", topk_idx, _INT64, (T, K), d)
        _checks.tensor("topk_weights", topk_weights, _FP32, (T, K), d)
        if out is not None:
            _checks.tensor("out", out, _BF16, (T, H), d, aligned16=True)
        zero_copy = _checks.flag("zero_copy", zero_copy)
        code = _REDUCE_FLAT
        if reduction is not None:
            code = _LL_REDUCTIONS.get(reduction) if isinstance(reduction, str) else None
            if code is None:
                if not isinstance(reduction, str):
                    raise TypeError(f"reduction must be a str or None, got {type(reduction).__name__}")
                raise ValueError(f"reduction must be 'flat', 'rank' or None, got {reduction!r}")
            if code == _REDUCE_RANK and getattr(h, "topk_slots", None) is None:
                raise ValueError("reduction='rank' needs a handle from low_latency_dispatch(..., topk_weights=...): "
                                 "the expert ranks sum with the weights that travelled with the tokens")
            if code == _REDUCE_RANK and use_logfmt:
                raise ValueError("use_logfmt is not offered with reduction='rank' (the partial sums travel as bf16)")
        if use_logfmt is not False:
            use_logfmt = _checks.flag("use_logfmt", use_logfmt)
            if use_logfmt and H % _LOGFMT_GROUP != 0:
                raise ValueError(f"use_logfmt needs hidden % {_LOGFMT_GROUP} == 0, got {H}")
        # Referenced, so that the tuple's id is not reused while it is remembered.
        self._ll_combine_last = (handle, x_shape, reduction, code)
        return h, T, H, zero_copy, use_logfmt, code

    # ---- rank masking (deep_ep's enable_shrink mode; semantics.md section 9) --------------------------------------
    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise ValueError(f"{what}: the Buffer was created without enable_shrink=True (rank masking)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """deep_ep's rank masking: marks rank_to_mask as masked (mask=True: this rank's low-latency calls neither send
        to nor wait for it, and its experts contribute nothing) or unmasked (mask=False, the default). This rank's
        own mask, in device memory, changed on the current stream (not collective; capturable in a CUDA graph).
        Only between low-latency calls (none waiting for its hook). After unmasking a rank, every rank must call
        clean_low_latency_buffer before its next low-latency call (the call is refused until then).

        Arguments:
            rank_to_mask: int, the rank in [0, R).
            mask: bool, default False.
        """
        self._require_shrink("low_latency_update_mask_buffer")
        rank_to_mask = _checks.integer("rank_to_mask", rank_to_mask, 0)
        mask = _checks.flag("mask", mask)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask must be in [0, {self.group_size}), "
                             f"got {rank_to_mask}")
        lib = _lib.lib()
        lib.check(lib.epx_ll_update_mask(self._ptr(), rank_to_mask, int(mask),
                                         torch.cuda.current_stream(self._device).cuda_stream))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """deep_ep's rank masking: writes this rank's mask into mask_status (1 masked, 0 not) on the current stream.
        A rank whose wait outlasted the shrink budget ($EPX_LL_SHRINK_TIMEOUT_S, default 1 s) is masked by the
        kernel that waited.

        Arguments:
            mask_status: int32 [R] on the Buffer's device, contiguous, written in place.
        """
        self._require_shrink("low_latency_query_mask_buffer")
        _checks.tensor("mask_status", mask_status, torch.int32, (self.group_size,), self._device)
        lib = _lib.lib()
        lib.check(lib.epx_ll_query_mask(self._ptr(), mask_status.data_ptr(),
                                        torch.cuda.current_stream(self._device).cuda_stream))

    def low_latency_clean_mask_buffer(self) -> None:
        """deep_ep's rank masking: unmasks every rank, on the current stream. Every rank must then call
        clean_low_latency_buffer before its next low-latency call."""
        self._require_shrink("low_latency_clean_mask_buffer")
        lib = _lib.lib()
        lib.check(lib.epx_ll_clean_mask(self._ptr(), torch.cuda.current_stream(self._device).cuda_stream))

    # ---- argument structs -----------------------------------------------------------------------------------------
    def _ll_dispatch_checks(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, topk_weights,
                            use_fp8, round_scale, use_ue8m0):
        """Every check of low_latency_dispatch but those of async_finish and return_recv_hook, in order. -> (the
        _LLDispatchState of these arguments, T)."""
        R, d = self.group_size, self._device
        _checks.tensor("x", x, _BF16, (None, None), d, aligned16=True)
        T, H = x.shape
        M, num_experts = self._ll_check_shape(num_max_dispatch_tokens_per_rank, H, num_experts)
        if T > M:
            raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank ({M})")
        _checks.tensor("topk_idx", topk_idx, _INT64, (T, None), d)
        K = _checks.integer("topk_idx.shape[1] (num_topk)", topk_idx.shape[1], 1, _lib.limits().ll_max_topk)
        L = num_experts // R
        if stats is not None:
            _checks.tensor("cumulative_local_expert_recv_stats", stats, _INT32, (L,), d)
        if topk_weights is not None:
            _checks.tensor("topk_weights", topk_weights, _FP32, (T, K), d)
        use_fp8 = _checks.flag("use_fp8", use_fp8)
        round_scale = _checks.flag("round_scale", round_scale)
        use_ue8m0 = _checks.flag("use_ue8m0", use_ue8m0)
        if use_fp8 and H % _FP8_GROUP != 0:
            raise ValueError(f"use_fp8 needs hidden % {_FP8_GROUP} == 0, got {H}")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True")
        if use_ue8m0 and H % (_FP8_GROUP * _UE8M0_PER_WORD) != 0:
            raise ValueError(f"use_ue8m0 needs hidden % {_FP8_GROUP * _UE8M0_PER_WORD} == 0, got {H}")
        s = self._ll_dispatch_state
        if s is None or (s.M, s.E, s.H, s.K, s.use_fp8, s.round_scale, s.use_ue8m0) != \
                (M, num_experts, H, K, use_fp8, round_scale, use_ue8m0):
            s = self._ll_dispatch_state = _LLDispatchState(self, M, num_experts, H, K, use_fp8, round_scale,
                                                           use_ue8m0)
        return s, T

    # ---- streams --------------------------------------------------------------------------------------------------
    @staticmethod
    def _ll_check_flags(async_finish, return_recv_hook) -> Tuple[bool, bool]:
        async_finish = _checks.flag("async_finish", async_finish)
        return_recv_hook = _checks.flag("return_recv_hook", return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (the hook runs the receive "
                             "phase on the current stream; there is nothing to wait for asynchronously)")
        return async_finish, return_recv_hook

    def _ll_begin(self, return_recv_hook: bool, async_finish: bool):
        """-> (raw launch stream, current stream or None). With a hook both phases run on the current stream;
        a synchronous call runs there too when Streams.direct allows (then None: no wait to add at the end);
        otherwise the communication stream, after it waited for the current one."""
        streams = self._streams
        if return_recv_hook:
            compute = streams.current()
            return streams.compute_raw, compute
        if not async_finish:
            raw = streams.direct()
            if raw is not None:
                return raw, None
        return streams.comm_raw, streams.begin(None)
