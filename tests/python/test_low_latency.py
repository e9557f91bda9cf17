"""epx.Buffer's low-latency methods on 2, 3 and 4 GPUs against the torch reference (_ref.py): dispatch rows,
counts and layout exact; FP8 rows equal to the reference quantization (plain, round_scale, UE8M0); combine
bit-identical, also with use_logfmt and reduction="rank"; hooks, async, zero-copy, out=, statistics, clean, double buffering and a CUDA
graph."""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import _dist  # noqa: E402
import _ref  # noqa: E402
from _common import Ctx, assert_bitwise, assert_one_kernel, profiled_kernels  # noqa: E402

M = 32      # num_max_dispatch_tokens_per_rank
H = 1024    # hidden (a multiple of 512 for UE8M0)
E = 24      # experts: divides over 2, 3 and 4 ranks
K = 4       # top-k


def setup(rank, world):
    import epx
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    buffer = epx.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True)
    buffer.set_timeout(30.0)
    buffer.clean_low_latency_buffer(M, H, E)
    return Ctx(rank, world, torch.device("cuda", rank), buffer)


def teardown(ctx):
    ctx.buffer.destroy()


# ---- helpers ----------------------------------------------------------------------------------------------------
def tokens_of(ctx, seed):
    return [1 + (seed * 7 + 11 * s) % M for s in range(ctx.world)]


def inputs(ctx, seed, counts=None):
    counts = counts or tokens_of(ctx, seed)
    return [_ref.make_inputs(seed, s, counts[s], H, E, K, empty_prob=0.15) for s in range(ctx.world)]


def on(ctx, mine):
    return mine.x.to(ctx.device), mine.topk_idx.to(ctx.device), mine.topk_weights.to(ctx.device)


def expert_factor(e):
    return 1.0 + e / 8  # exact in binary


def run_experts(ctx, recv_x):
    """Stand-in experts on the packed layout: local expert i scales its rows by expert_factor(global id)."""
    L = E // ctx.world
    y = torch.empty(recv_x.shape, dtype=torch.bfloat16, device=recv_x.device)
    for i in range(L):
        y[i] = _ref.scale_rows(recv_x[i], expert_factor(ctx.rank * L + i))
    return y


def combine_reference(ctx, mine, logfmt=False):
    return _ref.ll_combine(lambda e: _ref.scale_rows(mine.x, expert_factor(e)), mine.topk_idx, mine.topk_weights, H,
                           logfmt=logfmt)


def rank_reduced_reference(ctx, mine):
    return _ref.ll_combine_rank_reduced(lambda e: _ref.scale_rows(mine.x, expert_factor(e)), mine.topk_idx,
                                        mine.topk_weights, H, E, ctx.world)


def check_dispatch(ctx, all_inputs, recv_x, recv_count, handle, fp8=False, round_scale=False, ue8m0=False):
    L = E // ctx.world
    blocks = _ref.ll_blocks([i.topk_idx for i in all_inputs], ctx.rank, E)
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    assert handle[2:5] == (M, H, E)
    assert_bitwise("recv_count", recv_count, torch.tensor([sum(len(b) for b in blocks[i]) for i in range(L)],
                                                          dtype=torch.int32))
    if fp8:
        data, scales = recv_x
        groups = H // 128 // (4 if ue8m0 else 1)
        assert data.dtype == torch.float8_e4m3fn and data.shape == (L, ctx.world * M, H)
        assert scales.shape == (L, ctx.world * M, groups)
        assert scales.stride() == (groups * ctx.world * M, 1, ctx.world * M), "scales must be token-minor"
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
        quantized = [_ref.quantize(i.x, round_scale) for i in all_inputs]
        data, scales = data.cpu(), scales.cpu()
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (L, ctx.world * M, H)
        data = recv_x.cpu()
    for i in range(L):
        spans = []
        for s in range(ctx.world):
            begin, count = int(layout_range[i, s]) >> 32, int(layout_range[i, s]) & 0xFFFFFFFF
            tokens = blocks[i][s]
            assert count == len(tokens), f"expert {i} source {s}: {count} rows, expected {len(tokens)}"
            spans.append((begin, count))
            if not tokens:
                continue
            rows = slice(begin, begin + count)
            where = f"expert {i} source {s}"
            assert_bitwise(f"recv_src_info {where}", src_info[i, rows], torch.tensor(tokens, dtype=torch.int32))
            if not fp8:
                assert_bitwise(f"recv_x {where}", data[i, rows], all_inputs[s].x[tokens])
                continue
            q, sc = quantized[s]
            assert_bitwise(f"fp8 data {where}", data[i, rows], q[tokens])
            want_scales = _ref.ue8m0_pack(sc[tokens]) if ue8m0 else sc[tokens]
            assert_bitwise(f"fp8 scales {where}", scales[i, rows], want_scales)
        # the source blocks tile [0, recv_count) without gaps (their order may vary)
        spans = sorted(sp for sp in spans if sp[1] > 0)
        pos = 0
        for begin, count in spans:
            assert begin == pos, f"expert {i}: blocks {spans} leave a gap"
            pos += count


def dispatch_and_check(ctx, seed, counts=None, weights=False, **kwargs):
    """weights=True: the topk_weights travel with the dispatch (for reduction="rank")."""
    all_inputs = inputs(ctx, seed, counts)
    x, idx, w = on(ctx, all_inputs[ctx.rank])
    if weights:
        kwargs["topk_weights"] = w
    recv_x, recv_count, handle, event, hook = ctx.buffer.low_latency_dispatch(x, idx, M, E, **kwargs)
    if kwargs.get("return_recv_hook"):
        hook()
    if kwargs.get("async_finish"):
        event.current_stream_wait()
    check_dispatch(ctx, all_inputs, recv_x, recv_count, handle, fp8=kwargs.get("use_fp8", True),
                   round_scale=kwargs.get("round_scale", False), ue8m0=kwargs.get("use_ue8m0", False))
    return all_inputs, (x, idx, w), recv_x, handle


# ---- cases ---------------------------------------------------------------------------------------------------------
def case_dispatch_bf16_and_combine(ctx):
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 1, use_fp8=False)
    combined, event, hook = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle)
    assert event.event is None
    hook()  # a no-op without return_recv_hook
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_dispatch_fp8(ctx):
    dispatch_and_check(ctx, 2, use_fp8=True)


def case_dispatch_fp8_round_scale(ctx):
    dispatch_and_check(ctx, 3, use_fp8=True, round_scale=True)


def case_dispatch_fp8_ue8m0(ctx):
    dispatch_and_check(ctx, 4, use_fp8=True, round_scale=True, use_ue8m0=True)


def case_fp8_dispatch_then_combine(ctx):
    """Experts on dequantized FP8 rows (float(q) * scale, then bf16), combined exactly."""
    all_inputs, (x, idx, w), (data, scales), handle = dispatch_and_check(ctx, 5, use_fp8=True)
    L = E // ctx.world
    dequant = (data.float().view(L, -1, H // 128, 128) * scales.unsqueeze(3)).view(L, -1, H).to(torch.bfloat16)
    combined, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, dequant), idx, w, handle)
    mine = all_inputs[ctx.rank]
    q, sc = _ref.quantize(mine.x, False)
    mine_dq = (q.float().view(-1, H // 128, 128) * sc.unsqueeze(2)).view(-1, H).to(torch.bfloat16)
    want = _ref.ll_combine(lambda e: _ref.scale_rows(mine_dq, expert_factor(e)), mine.topk_idx, mine.topk_weights, H)
    assert_bitwise("combined_x (fp8 path)", combined, want)


def case_hooks(ctx):
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 6, use_fp8=False, return_recv_hook=True)
    combined, event, hook = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle,
                                                           return_recv_hook=True)
    hook()
    assert_bitwise("combined_x (hooks)", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_async(ctx):
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 7, use_fp8=False, async_finish=True)
    combined, event, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle,
                                                        async_finish=True)
    assert event.event is not None and event.extra_tensors
    with event:
        pass
    assert_bitwise("combined_x (async)", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_zero_copy_and_out(ctx):
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 8, use_fp8=False)
    area = ctx.buffer.get_next_low_latency_combine_buffer(handle)
    L = E // ctx.world
    assert area.dtype == torch.bfloat16 and area.shape == (L, ctx.world * M, H) and area.device == ctx.device
    y = run_experts(ctx, recv_x)
    area.copy_(y)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=ctx.device)
    combined, _, _ = ctx.buffer.low_latency_combine(y, idx, w, handle, zero_copy=True, out=out)
    assert combined is out
    assert_bitwise("combined_x (zero copy)", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_double_buffering(ctx):
    """The dispatch of step 2 is sent while the combine of step 1 is still being received."""
    first, (x1, idx1, w1), recv1, handle1 = dispatch_and_check(ctx, 9, use_fp8=False)
    combined1, _, combine1_recv = ctx.buffer.low_latency_combine(run_experts(ctx, recv1), idx1, w1, handle1,
                                                                 return_recv_hook=True)
    second = inputs(ctx, 10)
    x2, idx2, w2 = on(ctx, second[ctx.rank])
    recv2, count2, handle2, _, dispatch2_recv = ctx.buffer.low_latency_dispatch(x2, idx2, M, E, use_fp8=False,
                                                                                return_recv_hook=True)
    combine1_recv()
    dispatch2_recv()
    assert_bitwise("combined_x step 1", combined1, combine_reference(ctx, first[ctx.rank]))
    check_dispatch(ctx, second, recv2, count2, handle2)
    combined2, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv2), idx2, w2, handle2)
    assert_bitwise("combined_x step 2", combined2, combine_reference(ctx, second[ctx.rank]))


def case_cumulative_stats(ctx):
    L = E // ctx.world
    stats = torch.zeros(L, dtype=torch.int32, device=ctx.device)
    total = torch.zeros(L, dtype=torch.int32)
    for seed in (11, 12):
        all_inputs = inputs(ctx, seed)
        x, idx, w = on(ctx, all_inputs[ctx.rank])
        _, count, handle, _, _ = ctx.buffer.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                                 cumulative_local_expert_recv_stats=stats)
        total += count.cpu()
        # keep the buffer sets paired: every dispatch is followed by its combine
        ctx.buffer.low_latency_combine(torch.zeros(L, ctx.world * M, H, dtype=torch.bfloat16, device=ctx.device),
                                       idx, w, handle)
    assert_bitwise("cumulative_local_expert_recv_stats", stats, total)


def case_zero_tokens_on_rank0(ctx):
    counts = tokens_of(ctx, 13)
    counts[0] = 0
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 13, counts=counts, use_fp8=False)
    combined, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle)
    assert combined.shape == (counts[ctx.rank], H)
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_full_batch(ctx):
    counts = [M] * ctx.world
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 14, counts=counts, use_fp8=False)
    combined, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle)
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_clean_then_reuse(ctx):
    ctx.buffer.clean_low_latency_buffer(M, H, E)
    case_dispatch_bf16_and_combine(ctx)


def case_logfmt_combine(ctx):
    """use_logfmt: bit for bit the reference's encode, decode and sum; within 1e-5 of the BF16 combine by
    semantics.md section 9's measure."""
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 20, use_fp8=False)
    combined, event, hook = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle, use_logfmt=True)
    mine = all_inputs[ctx.rank]
    assert_bitwise("combined_x (logfmt)", combined, combine_reference(ctx, mine, logfmt=True))
    measure = _ref.diff_measure(combine_reference(ctx, mine), combined.cpu())
    assert 0 < measure < 1e-5, f"LogFMT vs BF16: {measure}"


def case_logfmt_hook_zero_copy_and_out(ctx):
    """use_logfmt with the receive hook, a zero-copy input and out=; then a BF16 combine on the same buffer."""
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 21, use_fp8=False)
    y = run_experts(ctx, recv_x)
    ctx.buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=ctx.device)
    combined, _, hook = ctx.buffer.low_latency_combine(y, idx, w, handle, use_logfmt=True, zero_copy=True,
                                                       return_recv_hook=True, out=out)
    hook()
    assert combined is out
    mine = all_inputs[ctx.rank]
    assert_bitwise("combined_x (logfmt, hook, zero copy)", combined, combine_reference(ctx, mine, logfmt=True))
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 22, use_fp8=False)
    combined, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle)
    assert_bitwise("combined_x (bf16 after logfmt)", combined, combine_reference(ctx, all_inputs[ctx.rank]))


def case_rank_reduced_combine(ctx):
    """reduction="rank": the weights travel with the dispatch; bit for bit the reference's per-rank partials
    summed in rank order; then a flat combine of the same handle (both orders on one dispatch)."""
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 30, use_fp8=False, topk_weights=None)
    with pytest.raises(ValueError, match="topk_weights"):
        ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle, reduction="rank")
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 31, use_fp8=False, weights=True)
    mine = all_inputs[ctx.rank]
    y = run_experts(ctx, recv_x)
    combined, event, hook = ctx.buffer.low_latency_combine(y, idx, w, handle, reduction="rank")
    assert_bitwise("combined_x (rank-reduced)", combined, rank_reduced_reference(ctx, mine))
    combined, _, _ = ctx.buffer.low_latency_combine(y, idx, w, handle, reduction="flat")
    assert_bitwise("combined_x (flat, same handle)", combined, combine_reference(ctx, mine))


def case_rank_reduced_fp8_hook_zero_copy_and_out(ctx):
    """reduction="rank" after an FP8 dispatch with hooks, a zero-copy input and out=."""
    all_inputs, (x, idx, w), recv_x, handle = dispatch_and_check(ctx, 32, return_recv_hook=True, weights=True)
    data, scales = recv_x
    L = E // ctx.world
    dequant = (data.float().view(L, -1, H // 128, 128) * scales.unsqueeze(-1)).view(L, -1, H).to(torch.bfloat16)
    y = run_experts(ctx, dequant)
    ctx.buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=ctx.device)
    combined, _, hook = ctx.buffer.low_latency_combine(y, idx, w, handle, zero_copy=True, return_recv_hook=True,
                                                       out=out, reduction="rank")
    hook()
    assert combined is out
    # the reference of the dequantized rows: each source's rows as its experts saw them
    mine = all_inputs[ctx.rank]
    q, sc = _ref.quantize(mine.x, False)
    deq = (q.float().view(-1, H // 128, 128) * sc.unsqueeze(-1)).view(-1, H).to(torch.bfloat16)
    want = _ref.ll_combine_rank_reduced(lambda e: _ref.scale_rows(deq, expert_factor(e)), mine.topk_idx,
                                        mine.topk_weights, H, E, ctx.world)
    assert_bitwise("combined_x (rank-reduced, fp8, hook, zero copy)", combined, want)


def case_rank_reduced_double_buffering(ctx):
    """Dispatch 2 sent while combine 1 (rank-reduced) is in flight."""
    all1, (x1, idx1, w1), recv1, handle1 = dispatch_and_check(ctx, 33, use_fp8=False, weights=True)
    combined1, _, combine1_recv = ctx.buffer.low_latency_combine(run_experts(ctx, recv1), idx1, w1, handle1,
                                                                 return_recv_hook=True, reduction="rank")
    all2, (x2, idx2, w2), recv2, handle2 = dispatch_and_check(ctx, 34, use_fp8=False, weights=True,
                                                              return_recv_hook=True)
    combine1_recv()
    assert_bitwise("combined_x 1 (rank-reduced)", combined1, rank_reduced_reference(ctx, all1[ctx.rank]))
    combined2, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv2), idx2, w2, handle2, reduction="rank")
    assert_bitwise("combined_x 2 (rank-reduced)", combined2, rank_reduced_reference(ctx, all2[ctx.rank]))


def case_rank_reduced_cuda_graph(ctx):
    cuda_graph(ctx, use_logfmt=False, reduction="rank")


def case_cuda_graph(ctx):
    cuda_graph(ctx, use_logfmt=False)


def case_logfmt_cuda_graph(ctx):
    cuda_graph(ctx, use_logfmt=True)


def cuda_graph(ctx, use_logfmt, reduction=None):
    """Dispatch, experts and combine captured once, replayed with new data."""
    counts = tokens_of(ctx, 15)
    first = inputs(ctx, 15, counts)
    static_x, static_idx, static_w = (t.clone() for t in on(ctx, first[ctx.rank]))
    rank = reduction == "rank"

    def step():
        recv_x, _, handle, _, _ = ctx.buffer.low_latency_dispatch(static_x, static_idx, M, E, use_fp8=False,
                                                                  topk_weights=static_w if rank else None)
        out, _, _ = ctx.buffer.low_latency_combine(run_experts(ctx, recv_x), static_idx, static_w, handle,
                                                   use_logfmt=use_logfmt, reduction=reduction)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads (NCCL watchdog) may query CUDA
        static_out = step()
    for seed in (16, 17, 18):
        data = inputs(ctx, seed, counts)
        x, idx, w = on(ctx, data[ctx.rank])
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        want = (rank_reduced_reference(ctx, data[ctx.rank]) if rank else
                combine_reference(ctx, data[ctx.rank], logfmt=use_logfmt))
        assert_bitwise(f"combined_x (graph replay, seed {seed})", static_out, want)


def case_local_buffer_tensor_of_the_low_latency_area(ctx):
    """Views of the low-latency (RDMA) area: size as created, addresses, write and read back; the buffer
    has no NVLink area. Writing there clobbers the low-latency signals: clean, then the calls work again."""
    import epx
    buf = ctx.buffer
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(M, H, ctx.world, E)
    whole = buf.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
    assert whole.shape == (rdma // 2,) and whole.device == ctx.device and whole.data_ptr() % 16 == 0
    sub = buf.get_local_buffer_tensor(torch.int64, (3, 5), offset=128, use_rdma_buffer=True)
    assert sub.shape == (3, 5) and sub.data_ptr() == whole.data_ptr() + 128
    want = torch.arange(15, dtype=torch.int64).view(3, 5) - 7 * ctx.rank
    sub.copy_(want.to(ctx.device))
    assert_bitwise("read back", buf.get_local_buffer_tensor(torch.int64, (3, 5), offset=128, use_rdma_buffer=True),
                   want)
    end = buf.get_local_buffer_tensor(torch.int32, offset=rdma - 64, use_rdma_buffer=True)
    assert end.shape == (16,) and end.data_ptr() == whole.data_ptr() + rdma - 64
    end.fill_(-1)
    with pytest.raises(ValueError, match="no NVLink buffer"):
        buf.get_local_buffer_tensor(torch.bfloat16)
    with pytest.raises(ValueError, match="needs"):
        buf.get_local_buffer_tensor(torch.uint8, (rdma - 127,), offset=128, use_rdma_buffer=True)
    del whole, sub, end
    case_clean_then_reuse(ctx)


def case_profiler_one_kernel_per_phase(ctx):
    """torch.profiler shows one kernel whose name contains "dispatch" per dispatch call and per phase (hook), and
    one with "combine" per combine call and phase. Every collective call comes before the checks."""
    x, idx, w = on(ctx, inputs(ctx, 32)[ctx.rank])
    seen = {}
    (recv_x, _, handle, _, _), seen["dispatch"] = profiled_kernels(
        lambda: ctx.buffer.low_latency_dispatch(x, idx, M, E, use_fp8=False))
    y = run_experts(ctx, recv_x)
    _, seen["combine"] = profiled_kernels(lambda: ctx.buffer.low_latency_combine(y, idx, w, handle))
    (recv_x, _, handle, _, hook), seen["dispatch send phase"] = profiled_kernels(
        lambda: ctx.buffer.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True))
    _, seen["dispatch receive phase"] = profiled_kernels(hook)
    y = run_experts(ctx, recv_x)
    (_, _, hook), seen["combine send phase"] = profiled_kernels(
        lambda: ctx.buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=True))
    _, seen["combine receive phase"] = profiled_kernels(hook)
    for what, names in seen.items():
        assert_one_kernel(what, names, what.split()[0])


def masked_view(ctx, all_inputs, victim):
    """The inputs as the model sees them with `victim` masked on every rank (semantics.md section 9): the victim's
    tokens are not received and slots on its experts count as -1; on the victim itself (it masked itself) every
    slot is -1."""
    L = E // ctx.world
    out = []
    for s, i in enumerate(all_inputs):
        idx = i.topk_idx.clone()
        if s == victim or ctx.rank == victim:
            idx[:] = -1
        else:
            idx[(idx >= 0) & (idx // L == victim)] = -1
        out.append(_ref.RankInputs(i.x, idx, i.topk_weights))
    return out


def case_shrink_mask_calls_and_a_masked_rank(ctx):
    import epx
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(M, H, ctx.world, E)
    buf = epx.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True, enable_shrink=True,
                     explicitly_destroy=True)
    try:
        buf.set_timeout(30.0)
        assert buf.enable_shrink is True
        victim = ctx.world - 1
        status = torch.full((ctx.world,), 7, dtype=torch.int32, device=ctx.device)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * ctx.world
        buf.low_latency_update_mask_buffer(victim, True)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == victim) for r in range(ctx.world)]
        for seed, hook in ((91, False), (92, True)):  # masked steps, with and without the receive hook
            all_inputs = inputs(ctx, seed)
            x, idx, w = on(ctx, all_inputs[ctx.rank])
            recv_x, recv_count, handle, _, hook_fn = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                                              return_recv_hook=hook)
            if hook:
                hook_fn()
            view = masked_view(ctx, all_inputs, victim)
            check_dispatch(ctx, view, recv_x, recv_count, handle)
            combined, _, hook_fn = buf.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle,
                                                           return_recv_hook=hook)
            if hook:
                hook_fn()
            assert_bitwise("combined_x (masked)", combined, combine_reference(ctx, view[ctx.rank]))
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * ctx.world
        x, idx, w = on(ctx, inputs(ctx, 93)[ctx.rank])
        with pytest.raises(epx.InvalidArgumentError, match="clean_low_latency_buffer"):
            buf.low_latency_dispatch(x, idx, M, E)  # an unmasked rank needs clean_low_latency_buffer first
        buf.clean_low_latency_buffer(M, H, E)
        all_inputs = inputs(ctx, 94)
        x, idx, w = on(ctx, all_inputs[ctx.rank])
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        check_dispatch(ctx, all_inputs, recv_x, recv_count, handle)
        combined, _, _ = buf.low_latency_combine(run_experts(ctx, recv_x), idx, w, handle)
        assert_bitwise("combined_x (unmasked again)", combined, combine_reference(ctx, all_inputs[ctx.rank]))
    finally:
        buf.destroy()


def case_shrink_off_refuses_the_mask_calls(ctx):
    assert ctx.buffer.enable_shrink is False
    with pytest.raises(ValueError, match="enable_shrink"):
        ctx.buffer.low_latency_update_mask_buffer(0, True)


CASES = [name for name in list(globals()) if name.startswith("case_")]


# ---- pytest side ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}gpus")
def results(request):
    _dist.require_gpus(request.param)
    return _dist.run_cases(os.path.abspath(__file__), CASES, request.param, timeout_s=180)


@pytest.mark.parametrize("case", CASES)
def test_low_latency(results, case):
    results.check(case)
