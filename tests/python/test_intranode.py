"""epx.Buffer's high-throughput methods on 2, 3 and 4 GPUs against the torch reference (_ref.py): layout,
dispatch (bit-exact), cached and worst-case dispatch, combine (bit-identical), FP8, async and
previous-event variants, and buffer lifetime. Each case runs on every rank (see _dist.py)."""

import gc
import os
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import _dist  # noqa: E402
import _ref  # noqa: E402
from _common import Ctx, assert_bitwise, assert_one_kernel, profiled_kernels  # noqa: E402
from _high_throughput import (E, H, H_MAX, K, async_layout_and_dispatch, cached_fp8_dispatch,  # noqa: E402
                              check_cached_fp8, check_recv_x, cuda, dispatch_fp8_column_major_scales,
                              expert_outputs, inputs, inputs_without_rank0, tokens_of, two_biases, worst_case_inputs)
from _high_throughput import layout_and_dispatch as layout_and_dispatch_in  # noqa: E402

SMALL = None       # a config with few SMs and small chunks, built in setup (needs the library)


def setup(rank, world):
    import epx
    global SMALL
    SMALL = epx.Config(8, 4, 32)
    configs = [epx.Buffer.get_dispatch_config(world), epx.Buffer.get_combine_config(world), SMALL]
    nvl_bytes = max(c.get_nvl_buffer_size_hint(H_MAX * 2, world) for c in configs)
    # The output region of the in-buffer cases: every rank's tokens (tokens_of: fewer than 160 a rank) at H_MAX.
    recv_bytes = epx.Buffer.get_recv_region_size_hint(160 * world, H_MAX, K)
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=nvl_bytes, num_recv_bytes=recv_bytes)
    buffer.set_timeout(30.0)
    return Ctx(rank, world, torch.device("cuda", rank), buffer, {"nvl_bytes": nvl_bytes})


def teardown(ctx):
    ctx.buffer.destroy()


# ---- helpers ----------------------------------------------------------------------------------------------------
def layout_and_dispatch(ctx, all_inputs, **kwargs):
    """The shared layout + dispatch (_high_throughput.py) with the intranode layout: no per-domain counts."""
    return layout_and_dispatch_in(ctx, all_inputs, internode=False, **kwargs)


def combine_reference(ctx, all_inputs, biases=()):
    mine = all_inputs[ctx.rank]
    in_rank = _ref.layout(mine.topk_idx, E, ctx.world)[2]
    rows = [_ref.scale_rows(mine.x, 1.0 + j / 4) for j in range(ctx.world)]
    return _ref.combine(rows, in_rank, biases), in_rank


# ---- cases ---------------------------------------------------------------------------------------------------------
def case_layout(ctx):
    all_inputs = inputs(ctx, 1, tokens_of(ctx, 1), empty_prob=0.3)
    idx = cuda(all_inputs[ctx.rank].topk_idx, ctx)
    ntr, nrr, nte, itr, event = ctx.buffer.get_dispatch_layout(idx, E)
    want = _ref.layout(all_inputs[ctx.rank].topk_idx, E, ctx.world)
    assert nrr is None and event.event is None
    assert_bitwise("num_tokens_per_rank", ntr, want[0])
    assert_bitwise("num_tokens_per_expert", nte, want[1])
    assert_bitwise("is_token_in_rank", itr, want[2])


def case_dispatch_combine_bf16(ctx):
    all_inputs = inputs(ctx, 2, tokens_of(ctx, 2))
    (recv_x, recv_idx, recv_w, per_expert, handle, event), ref = layout_and_dispatch(ctx, all_inputs)
    assert event.event is None and len(handle) == 6
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert_bitwise("recv_topk_weights", recv_w, ref.recv_topk_weights)
    assert per_expert == ref.per_expert, (per_expert, ref.per_expert)
    assert_bitwise("handle[0] rank_prefix_matrix", handle[0], ref.rank_prefix_matrix)
    assert_bitwise("handle[3] recv_src_idx", handle[3], ref.recv_src_idx)
    assert handle[1].shape == (ctx.world, ctx.buffer.get_dispatch_config(ctx.world).num_sms // 2)

    combined, combined_w, event = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, topk_weights=recv_w)
    want, in_rank = combine_reference(ctx, all_inputs)
    assert_bitwise("combined_x", combined, want)
    mine = all_inputs[ctx.rank]
    # Rank j sends back the weights it received: the source weight where the expert is on j, else 0.
    L = E // ctx.world
    per_rank_w = [torch.where(mine.topk_idx // L == j, mine.topk_weights, torch.zeros_like(mine.topk_weights))
                  for j in range(ctx.world)]
    assert_bitwise("combined_topk_weights", combined_w, _ref.combine_weights(per_rank_w, in_rank))
    # Deterministic: the same call gives the same bits.
    again, _, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, topk_weights=recv_w)
    assert_bitwise("combined_x (second run)", again, combined)


def case_dispatch_fp8(ctx):
    all_inputs = inputs(ctx, 3, tokens_of(ctx, 3))
    (recv_x, recv_idx, _, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs, fp8_scales=H // 128)
    assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn
    check_recv_x(recv_x, ref, all_inputs, fp8_scales=H // 128)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert per_expert == ref.per_expert
    # cached FP8 dispatch of new data over the same routing
    cached = cached_fp8_dispatch(ctx, all_inputs[ctx.rank], handle)
    check_cached_fp8(cached, ref, all_inputs)


def case_expert_alignment(ctx):
    all_inputs = inputs(ctx, 4, tokens_of(ctx, 4))
    (_, _, _, per_expert, _, _), ref = layout_and_dispatch(ctx, all_inputs, expert_alignment=32)
    assert per_expert == ref.per_expert and all(c % 32 == 0 for c in per_expert)


def case_no_topk(ctx):
    all_inputs = inputs(ctx, 5, tokens_of(ctx, 5))
    (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(
        ctx, all_inputs, with_topk=False, with_weights=False)
    assert recv_idx is None and recv_w is None and per_expert == []
    check_recv_x(recv_x, ref, all_inputs)
    combined, combined_w, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle)
    assert combined_w is None
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])


def case_topk_without_weights(ctx):
    all_inputs = inputs(ctx, 6, tokens_of(ctx, 6))
    (recv_x, recv_idx, recv_w, per_expert, _, _), ref = layout_and_dispatch(ctx, all_inputs, with_weights=False)
    assert recv_w is None
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert per_expert == ref.per_expert
    check_recv_x(recv_x, ref, all_inputs)


def case_worst_case_mode(ctx):
    all_inputs, worst = worst_case_inputs(ctx, 7)
    (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs,
                                                                               num_worst_tokens=worst)
    N = len(ref.src)
    assert recv_x.shape[0] == worst and handle[3].shape[0] == worst and per_expert == []
    check_recv_x(recv_x, ref, all_inputs, rows=N)
    assert_bitwise("recv_topk_idx", recv_idx[:N], ref.recv_topk_idx)
    assert bool((recv_idx[N:] == -1).all()), "padding rows must have no experts"
    assert bool((recv_w[N:] == 0).all())
    assert bool((handle[3][N:] == -1).all()), "padding rows have source index -1"
    y = expert_outputs(ctx, recv_x)
    combined, _, _ = ctx.buffer.combine(y, handle)
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])
    cached = ctx.buffer.dispatch(cuda(all_inputs[ctx.rank].x, ctx), handle=handle)[0]
    check_recv_x(cached, ref, all_inputs, rows=N)


def case_dispatch_fp8_column_major_scales(ctx):
    """Column-major FP8 scales in normal, cached and worst-case dispatch (_high_throughput.py)."""
    dispatch_fp8_column_major_scales(ctx, internode=False)


def case_cached_dispatch_bf16(ctx):
    all_inputs = inputs(ctx, 8, tokens_of(ctx, 8))
    (_, _, _, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
    for step in range(2):
        new = [_ref.scale_rows(i.x, 3.0 + step) for i in all_inputs]
        recv, a, b, c, d, event = ctx.buffer.dispatch(cuda(new[ctx.rank], ctx), handle=handle)
        assert (a, b, c, d) == (None, None, None, None) and event.event is None
        assert_bitwise(f"cached recv_x step {step}", recv, _ref.gather_rows(new, ref.src, H, torch.bfloat16))


def case_combine_biases(ctx):
    all_inputs = inputs(ctx, 9, tokens_of(ctx, 9))
    (recv_x, _, _, _, handle, _), _ = layout_and_dispatch(ctx, all_inputs)
    b0, b1 = two_biases(ctx, all_inputs[ctx.rank], 9)
    y = expert_outputs(ctx, recv_x)
    one, _, _ = ctx.buffer.combine(y, handle, bias=cuda(b0, ctx))
    assert_bitwise("combined_x + bias0", one, combine_reference(ctx, all_inputs, (b0,))[0])
    two, _, _ = ctx.buffer.combine(y, handle, bias=(cuda(b0, ctx), cuda(b1, ctx)))
    assert_bitwise("combined_x + bias0 + bias1", two, combine_reference(ctx, all_inputs, (b0, b1))[0])


def case_async_and_previous_event(ctx):
    import epx
    all_inputs = inputs(ctx, 10, tokens_of(ctx, 10))
    mine = all_inputs[ctx.rank]
    x, (recv_x, recv_idx, _, _, handle, _), side = async_layout_and_dispatch(ctx, mine, internode=False)
    ref = _ref.dispatch([i.topk_idx for i in all_inputs], [i.topk_weights for i in all_inputs], ctx.rank, E)
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    y = expert_outputs(ctx, recv_x)
    combined, _, event = ctx.buffer.combine(y, handle, previous_event=epx.Buffer.capture(), async_finish=True)
    event.current_stream_wait()
    assert_bitwise("combined_x (async)", combined, combine_reference(ctx, all_inputs)[0])
    # async without allocate_on_comm_stream, previous event from an earlier async op
    cached, _, _, _, _, event = ctx.buffer.dispatch(x, handle=handle, async_finish=True)
    combined, _, event = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, previous_event=event,
                                            async_finish=True)
    event.current_stream_wait()
    check_recv_x(cached, ref, all_inputs)
    assert_bitwise("combined_x (chained events)", combined, combine_reference(ctx, all_inputs)[0])
    assert float(side[0, 0]) == 64.0


def case_zero_tokens_on_rank0(ctx):
    all_inputs, counts = inputs_without_rank0(ctx, 11)
    (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_weights", recv_w, ref.recv_topk_weights)
    combined, combined_w, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, topk_weights=recv_w)
    assert combined.shape == (counts[ctx.rank], H)
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])


def case_small_config_and_wide_rows(ctx):
    all_inputs = inputs(ctx, 12, tokens_of(ctx, 12, base=300), hidden=H_MAX)
    (recv_x, _, _, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs, config=SMALL)
    assert handle[1].shape[1] == SMALL.num_sms // 2
    check_recv_x(recv_x, ref, all_inputs)
    # combine's default config takes the dispatch's num_sms from the handle
    combined, _, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle)
    mine = all_inputs[ctx.rank]
    in_rank = _ref.layout(mine.topk_idx, E, ctx.world)[2]
    want = _ref.combine([_ref.scale_rows(mine.x, 1.0 + j / 4) for j in range(ctx.world)], in_rank)
    assert_bitwise("combined_x", combined, want)


def case_set_num_sms(ctx):
    import epx
    saved = epx.Buffer.num_sms
    try:
        epx.Buffer.set_num_sms(4)
        all_inputs = inputs(ctx, 13, tokens_of(ctx, 13))
        (recv_x, _, _, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
        assert handle[1].shape[1] == 2
        check_recv_x(recv_x, ref, all_inputs)
        combined, _, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle)
        assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])
    finally:
        epx.Buffer.num_sms = saved


def case_buffer_over_nccl_group(ctx):
    """The bootstrap's all-gather of bytes (epx.bootstrap.all_gather_bytes) on an NCCL group, and explicit
    destruction."""
    import epx
    group = dist.new_group(backend="nccl")
    buffer = epx.Buffer(group, num_nvl_bytes=ctx.extra["nvl_bytes"], explicitly_destroy=True)
    try:
        all_inputs = inputs(ctx, 14, tokens_of(ctx, 14))
        other = Ctx(ctx.rank, ctx.world, ctx.device, buffer)
        (recv_x, _, _, _, handle, _), ref = layout_and_dispatch(other, all_inputs)
        check_recv_x(recv_x, ref, all_inputs)
        combined, _, _ = buffer.combine(expert_outputs(ctx, recv_x), handle)
        assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])
    finally:
        buffer.destroy()
        buffer.destroy()  # idempotent
    with pytest.raises(epx.FailedStateError):
        buffer.get_dispatch_layout(cuda(all_inputs[ctx.rank].topk_idx, ctx), E)
    dist.destroy_process_group(group)


def case_destroyed_by_garbage_collection(ctx):
    import epx
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22)
    native = buffer._native
    ref = weakref.ref(buffer)
    del buffer
    gc.collect()  # every rank at the same point: destruction is collective
    assert ref() is None and native.ptr is None


def case_out_of_range_expert_is_reported(ctx):
    """Found on the device by rank 0's layout kernel, shared by the next notify: dispatch raises on every
    rank (InvalidArgumentError naming the slot on rank 0, RemoteError elsewhere); the buffer stays usable."""
    import epx
    ctx.buffer.check()  # nothing recorded so far
    all_inputs = inputs(ctx, 15, tokens_of(ctx, 15))
    bad = all_inputs[ctx.rank].topk_idx.clone()
    if ctx.rank == 0:
        bad[3, 1] = E  # one past the last expert
    idx = cuda(bad, ctx)
    ntr, _, nte, itr, _ = ctx.buffer.get_dispatch_layout(idx, E)
    with pytest.raises(epx.EpxError) as info:
        ctx.buffer.dispatch(cuda(all_inputs[ctx.rank].x, ctx), num_tokens_per_rank=ntr, is_token_in_rank=itr,
                            num_tokens_per_expert=nte, topk_idx=idx)
    if ctx.rank == 0:
        assert isinstance(info.value, epx.InvalidArgumentError) and "topk_idx" in str(info.value), info.value
    else:
        assert isinstance(info.value, epx.RemoteError), info.value
    dist.barrier()
    case_dispatch_combine_bf16(ctx)


def case_check_reports_a_layout_error_first(ctx):
    """check() reports this rank's own pending input error before any notify shares it."""
    import epx
    idx = torch.full((8, K), -1, dtype=torch.int64)
    idx[5, 2] = -7
    ctx.buffer.get_dispatch_layout(cuda(idx, ctx), E)
    with pytest.raises(epx.InvalidArgumentError, match="topk_idx"):
        ctx.buffer.check()
    ctx.buffer.check()  # reported once, then cleared
    dist.barrier()
    case_dispatch_combine_bf16(ctx)


def case_local_buffer_tensor(ctx):
    """Views of the NVLink ring area: shapes, dtypes and addresses as asked, writes read back (the same bytes
    through another dtype too), range errors; the buffer works as before afterwards (the ring area holds no
    state between operations)."""
    buf, nvl = ctx.buffer, ctx.extra["nvl_bytes"]
    whole = buf.get_local_buffer_tensor(torch.bfloat16)
    assert whole.dtype == torch.bfloat16 and whole.shape == (nvl // 2,), (whole.dtype, whole.shape)
    assert whole.device == ctx.device and whole.is_contiguous()
    base = whole.data_ptr()
    assert base % 16 == 0
    t = buf.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=64)
    assert t.shape == (4, 8) and t.dtype == torch.float32 and t.data_ptr() == base + 64
    want = torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * ctx.rank
    t.copy_(want.to(ctx.device))
    assert_bitwise("read back", buf.get_local_buffer_tensor(torch.float32, (4, 8), offset=64), want)
    as_int = buf.get_local_buffer_tensor(torch.int32, 32, offset=64)
    assert as_int.data_ptr() == base + 64
    assert_bitwise("the same bytes as int32", as_int, want.view(-1).view(torch.int32))
    tail = buf.get_local_buffer_tensor(torch.uint8, offset=nvl - 16)
    assert tail.shape == (16,) and tail.data_ptr() == base + nvl - 16
    tail.fill_(7)
    assert int(tail.sum()) == 7 * 16
    assert buf.get_local_buffer_tensor(torch.uint8, 0, offset=nvl).numel() == 0
    with pytest.raises(ValueError, match="needs"):
        buf.get_local_buffer_tensor(torch.float32, (nvl // 4 + 1,))
    with pytest.raises(ValueError, match="multiple"):
        buf.get_local_buffer_tensor(torch.float32, offset=2)
    with pytest.raises(ValueError, match="no low-latency"):
        buf.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
    del whole, t, as_int, tail
    case_dispatch_combine_bf16(ctx)


def case_local_buffer_tensor_keeps_the_buffer_alive(ctx):
    """A view keeps a dropped Buffer from being garbage-collected (which would free the memory under it)."""
    import epx
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
    native = buffer._native
    view = buffer.get_local_buffer_tensor(torch.int32, (16,))
    view.fill_(ctx.rank)
    ref = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert ref() is not None and native.ptr is not None, "the Buffer was destroyed under a live view"
    assert int(view.sum()) == 16 * ctx.rank
    del view  # the last reference: every rank at the same point, destruction is collective
    gc.collect()
    assert ref() is None and native.ptr is None


def case_destroy_warns_about_live_views(ctx):
    import epx
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    view = buffer.get_local_buffer_tensor(torch.uint8)
    with pytest.warns(RuntimeWarning, match="still alive"):
        buffer.destroy()
    with pytest.raises(epx.FailedStateError):
        buffer.get_local_buffer_tensor(torch.uint8)
    del view


def case_in_buffer_dispatch_combine_bf16(ctx):
    """outputs_in_buffer: the outputs are views of the Buffer's output region, bit-exact; the handle owns its
    recv_src_idx; combine and a cached dispatch into the buffer work from that handle."""
    all_inputs = inputs(ctx, 40, tokens_of(ctx, 40))
    (recv_x, recv_idx, recv_w, per_expert, handle, event), ref = layout_and_dispatch(ctx, all_inputs,
                                                                                     outputs_in_buffer=True)
    assert event.event is None and len(handle) == 6
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert_bitwise("recv_topk_weights", recv_w, ref.recv_topk_weights)
    assert per_expert == ref.per_expert, (per_expert, ref.per_expert)
    assert_bitwise("handle[3] recv_src_idx", handle[3], ref.recv_src_idx)
    combined, combined_w, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, topk_weights=recv_w)
    want = combine_reference(ctx, all_inputs)[0]
    assert_bitwise("combined_x", combined, want)
    # The combine from the buffer: the expert outputs written over recv_x in place, the dispatch's weights where
    # they are; the same bits.
    recv_x.copy_(expert_outputs(ctx, recv_x))
    from_buffer, from_buffer_w, _ = ctx.buffer.combine(recv_x, handle, topk_weights=recv_w, inputs_in_buffer=True)
    assert_bitwise("combined_x from the buffer", from_buffer, want)
    assert_bitwise("combined_topk_weights from the buffer", from_buffer_w, combined_w)
    x_view, w_view = ctx.buffer.get_combine_input_buffer(handle, H, K)
    assert x_view.data_ptr() == recv_x.data_ptr() and w_view.data_ptr() == recv_w.data_ptr()
    with pytest.raises(ValueError, match="get_combine_input_buffer"):
        ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, inputs_in_buffer=True)
    new = [_ref.scale_rows(i.x, 5.0) for i in all_inputs]
    recv, a, b, c, d, _ = ctx.buffer.dispatch(cuda(new[ctx.rank], ctx), handle=handle, outputs_in_buffer=True)
    assert (a, b, c, d) == (None, None, None, None)
    assert_bitwise("cached in-buffer recv_x", recv, _ref.gather_rows(new, ref.src, H, torch.bfloat16))
    # A plain cached dispatch of the same handle still works, into tensors of its own.
    again = ctx.buffer.dispatch(cuda(all_inputs[ctx.rank].x, ctx), handle=handle)[0]
    check_recv_x(again, ref, all_inputs)


def case_in_buffer_fp8_and_worst_case(ctx):
    all_inputs = inputs(ctx, 41, tokens_of(ctx, 41))
    (recv_x, recv_idx, _, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs, fp8_scales=H // 128,
                                                                       outputs_in_buffer=True)
    assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn
    check_recv_x(recv_x, ref, all_inputs, fp8_scales=H // 128)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert per_expert == ref.per_expert
    # After an FP8 dispatch the combine's rows overlap its outputs: written once those are read.
    y = expert_outputs(ctx, _ref.gather_rows([i.x for i in all_inputs], ref.src, H, torch.bfloat16).to(ctx.device))
    x_view, w_view = ctx.buffer.get_combine_input_buffer(handle, H)
    assert w_view is None and x_view.shape == y.shape
    x_view.copy_(y)
    combined, _, _ = ctx.buffer.combine(x_view, handle, inputs_in_buffer=True)
    assert_bitwise("combined_x from the buffer after FP8", combined, combine_reference(ctx, all_inputs)[0])
    all_inputs, worst = worst_case_inputs(ctx, 42)
    (recv_x, recv_idx, recv_w, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs, num_worst_tokens=worst,
                                                                        outputs_in_buffer=True)
    N = len(ref.src)
    assert recv_x.shape[0] == worst and handle[3].shape[0] == worst
    check_recv_x(recv_x, ref, all_inputs, rows=N)
    assert bool((recv_idx[N:] == -1).all()) and bool((recv_w[N:] == 0).all())
    assert bool((handle[3][N:] == -1).all())
    combined, _, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle)
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs)[0])
    recv_x.copy_(expert_outputs(ctx, recv_x))
    from_buffer, _, _ = ctx.buffer.combine(recv_x, handle, inputs_in_buffer=True)
    assert_bitwise("combined_x from the buffer, worst-case", from_buffer, combined)


def case_in_buffer_region_too_small(ctx):
    """More rows than the region holds: every rank's call raises BufferTooSmallError, and the Buffer stays
    usable."""
    import epx
    counts = [2000] * ctx.world  # every token to expert 0: rank 0 receives 2000 x R rows of H_MAX, past the region
    all_inputs = inputs(ctx, 43, counts, hidden=H_MAX)
    for i in all_inputs:
        i.topk_idx.fill_(-1)
        i.topk_idx[:, 0] = 0
    with pytest.raises(epx.BufferTooSmallError, match="num_recv_bytes"):
        layout_and_dispatch(ctx, all_inputs, outputs_in_buffer=True)
    all_inputs = inputs(ctx, 44, tokens_of(ctx, 44))
    (recv_x, _, _, _, _, _), ref = layout_and_dispatch(ctx, all_inputs, outputs_in_buffer=True)
    check_recv_x(recv_x, ref, all_inputs)


def case_sized_dispatch(ctx):
    """From the second dispatch with a token count on, the outputs are sized by a guess from the earlier calls' rows
    and the data kernel follows the count exchange at once (high_throughput.py, _sized_rows). The outputs are the
    first N rows of the guessed ones, bit-exact; a call whose rows exceed a rank's guess repeats on every rank (two
    steps, exact sizes) and is exact too; the handle serves combine. Token counts of its own (170 + rank), so no
    other case's calls feed the guesses."""
    buf = ctx.buffer
    counts = [170 + s for s in range(ctx.world)]
    T = counts[ctx.rank]
    buf._recv_rows.pop(T, None)
    sparse = inputs(ctx, 40, counts, empty_prob=0.9)
    dense = inputs(ctx, 41, counts, empty_prob=0.0)
    # (inputs, whether the outputs are views of guessed rows): the first call has no guess; a dense call after a
    # sparse one finds every rank's guess from the sparse rows too small and repeats in two steps.
    steps = [(sparse, False), (sparse, True), (dense, False), (dense, True), (dense, None)]
    for step, (all_inputs, sized) in enumerate(steps):
        if sized is None:
            buf._sized_dispatch = False  # EPX_HT_SIZED_DISPATCH=0: two steps
        try:
            (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
        finally:
            buf._sized_dispatch = True
        N = len(ref.src)
        assert recv_x.shape == (N, H) and recv_x.is_contiguous() and handle[3].shape == (N,), (step, recv_x.shape)
        exact = recv_x.untyped_storage().nbytes() == N * H * 2
        assert exact != bool(sized), (step, N, recv_x.untyped_storage().nbytes())
        check_recv_x(recv_x, ref, all_inputs)
        assert_bitwise(f"recv_topk_idx (call {step})", recv_idx, ref.recv_topk_idx)
        assert_bitwise(f"recv_topk_weights (call {step})", recv_w, ref.recv_topk_weights)
        assert per_expert == ref.per_expert, (step, per_expert, ref.per_expert)
        assert_bitwise(f"handle[0] (call {step})", handle[0], ref.rank_prefix_matrix)
        assert_bitwise(f"handle[3] recv_src_idx (call {step})", handle[3], ref.recv_src_idx)
        combined, _, _ = buf.combine(expert_outputs(ctx, recv_x), handle, topk_weights=recv_w)
        assert_bitwise(f"combined_x (call {step})", combined, combine_reference(ctx, all_inputs)[0])


def case_profiler_one_kernel_per_call(ctx):
    """torch.profiler shows one kernel whose name contains "dispatch" per dispatch (normal and cached) and one
    with "combine" per combine, and neither word for the layout: users time the calls by kernel name. Every
    collective call comes before the checks."""
    mine = inputs(ctx, 31, tokens_of(ctx, 31))[ctx.rank]
    idx, w, x = cuda(mine.topk_idx, ctx), cuda(mine.topk_weights, ctx), cuda(mine.x, ctx)
    # A guess from earlier cases' calls with this token count could be too small, and the repeat would add a dispatch
    # kernel: two steps here.
    ctx.buffer._sized_dispatch = False
    (ntr, _, nte, itr, _), layout = profiled_kernels(lambda: ctx.buffer.get_dispatch_layout(idx, E))
    out, normal = profiled_kernels(lambda: ctx.buffer.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                               num_tokens_per_expert=nte, topk_idx=idx,
                                                               topk_weights=w))
    recv_x, _, recv_w, _, handle, _ = out
    _, cached = profiled_kernels(lambda: ctx.buffer.dispatch(x, handle=handle))
    ctx.buffer._sized_dispatch = True
    y = expert_outputs(ctx, recv_x)
    _, combine = profiled_kernels(lambda: ctx.buffer.combine(y, handle, topk_weights=recv_w))
    assert_one_kernel("dispatch", normal, "dispatch")
    assert_one_kernel("cached dispatch", cached, "dispatch")
    assert_one_kernel("combine", combine, "combine")
    assert not [n for n in layout if "dispatch" in n.lower() or "combine" in n.lower()], layout


CASES = [name for name in list(globals()) if name.startswith("case_")]


# ---- pytest side ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}gpus")
def results(request):
    _dist.require_gpus(request.param)
    return _dist.run_cases(os.path.abspath(__file__), CASES, request.param, timeout_s=180)


@pytest.mark.parametrize("case", CASES)
def test_intranode(results, case):
    results.check(case)
