"""Direct ctypes calls of the C functions with prebuilt structs and preallocated outputs: the baseline
that both host-overhead timers (overhead.py on GPUs, overhead_cpu.py with the stub library) hold the Python API
against, and the host timer they share."""

import time
from ctypes import byref, c_int

import torch

from epx import _lib


def intranode_calls(lib, ptr, stream, c_config, handle_struct, x, is_token_in_rank, recv_x, recv_w, w, hidden, topk):
    """-> (dispatch, combine): each makes one C call on `stream` (cached bf16 dispatch of x with the handle,
    combine of recv_x with recv_w); c_config must have the dispatch's num_sms. Outputs and structs made here
    live as long as the two callables."""
    tokens, rows = x.shape[0], recv_x.shape[0]
    out_x = torch.empty_like(recv_x)
    combined, combined_w = torch.empty_like(x), torch.empty_like(w)
    d_args = _lib.DispatchArgs(x.data_ptr(), _lib.EPX_BF16, tokens, hidden, None, 0, 0, 0, None, None, 0, 0, None,
                               None, is_token_in_rank.data_ptr(), 1, 0)
    d_outs = _lib.DispatchOutputs(out_x.data_ptr(), None, None, None, rows)
    c_args = _lib.CombineArgs(recv_x.data_ptr(), rows, hidden, recv_w.data_ptr(), topk, None, None)
    c_outs = _lib.CombineOutputs(combined.data_ptr(), combined_w.data_ptr())
    refs = [byref(v) for v in (d_args, c_config, handle_struct, d_outs, c_args, c_outs)]
    keep = (out_x, combined, combined_w)
    dispatch_cached, combine_fn = lib.epx_dispatch_cached, lib.epx_combine

    def dispatch():
        if dispatch_cached(ptr, refs[0], refs[1], refs[2], refs[3], stream):
            lib.check(1)

    def combine():
        if combine_fn(ptr, refs[4], refs[1], refs[2], refs[5], stream):
            lib.check(1)

    dispatch.keep = combine.keep = keep
    return dispatch, combine


def low_latency_calls(lib, ptr, stream, x, idx, w, y, hidden, topk, experts, max_tokens, world):
    """-> (dispatch, combine): each makes one C call (bf16 dispatch / combine, both phases) on `stream`.
    x [M, hidden] bf16, idx [M, topk], w [M, topk] float32 and y (expert outputs, [L, world * M, hidden]) are
    the caller's; the outputs and structs made here live as long as the two callables."""
    L = experts // world
    packed = torch.empty(L, world * max_tokens, hidden, dtype=torch.bfloat16, device=x.device)
    count = torch.empty(L, dtype=torch.int32, device=x.device)
    src_info = torch.empty(L, world * max_tokens, dtype=torch.int32, device=x.device)
    layout_range = torch.empty(L, world, dtype=torch.int64, device=x.device)
    out = torch.empty_like(x)
    d_args = _lib.LLDispatchArgs(x.data_ptr(), max_tokens, hidden, idx.data_ptr(), topk, experts, max_tokens, 0, 0, 0,
                                 None)
    d_outs = _lib.LLDispatchOutputs(packed.data_ptr(), None, count.data_ptr(), src_info.data_ptr(),
                                    layout_range.data_ptr())
    handle = _lib.LLHandle()
    c_args = _lib.LLCombineArgs(y.data_ptr(), 0, idx.data_ptr(), w.data_ptr())
    buffer_set = c_int(0)
    refs = [byref(v) for v in (d_args, d_outs, handle, c_args, buffer_set)]
    keep = (packed, count, src_info, layout_range, out)
    ll_dispatch, ll_combine, out_ptr = lib.epx_ll_dispatch, lib.epx_ll_combine, out.data_ptr()

    def dispatch():
        if ll_dispatch(ptr, refs[0], refs[1], _lib.EPX_LL_BOTH, refs[2], stream):
            lib.check(1)

    def combine():
        if ll_combine(ptr, refs[3], refs[2], out_ptr, _lib.EPX_LL_BOTH, refs[4], stream):
            lib.check(1)

    dispatch.keep = combine.keep = keep
    return dispatch, combine


def layout_call(lib, ptr, stream, idx, experts, world):
    """-> a callable making one epx_get_dispatch_layout call on `stream` for idx [T, K] into preallocated outputs."""
    tokens, topk = idx.shape
    per_rank = torch.empty(world, dtype=torch.int32, device=idx.device)
    per_expert = torch.empty(experts, dtype=torch.int32, device=idx.device)
    in_rank = torch.empty(tokens, world, dtype=torch.bool, device=idx.device)
    args = _lib.LayoutArgs(idx.data_ptr(), tokens, topk, experts)
    outs = _lib.LayoutOutputs(per_rank.data_ptr(), None, per_expert.data_ptr(), in_rank.data_ptr())
    refs = (byref(args), byref(outs))
    fn = lib.epx_get_dispatch_layout

    def call():
        if fn(ptr, refs[0], refs[1], stream):
            lib.check(1)

    call.keep = (per_rank, per_expert, in_rank, args, outs)
    return call


def best_host_us(fn, calls, reps):
    """Best microseconds of host time per call over reps runs of calls back-to-back calls of fn."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best
