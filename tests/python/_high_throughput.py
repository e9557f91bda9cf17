"""What the high-throughput test modules (test_intranode.py, test_internode.py) share: the case shapes, their
inputs, layout + dispatch against the reference, the received-rows check, the stand-in expert, and the cases
whose bodies are the same in both modes. `internode` says which module calls: its dispatch takes the per-domain
counts of the layout, the intranode one has none."""

import torch

import _ref
from _common import assert_bitwise

H = 512            # hidden of most cases
H_MAX = 1024
E = 48             # experts: divides over 2, 3 and 4 ranks
K = 4              # top-k


def tokens_of(ctx, seed, base=96):
    """Token counts differ per rank (and by seed) so that uneven traffic is the normal case."""
    return [base + (seed * 13 + 29 * s) % 57 for s in range(ctx.world)]


def inputs(ctx, seed, counts, hidden=H, experts=E, topk=K, empty_prob=0.1):
    return [_ref.make_inputs(seed, s, counts[s], hidden, experts, topk, empty_prob) for s in range(ctx.world)]


def inputs_without_rank0(ctx, seed):
    """-> (inputs of tokens_of(seed) but none on rank 0, the token counts)."""
    counts = tokens_of(ctx, seed)
    counts[0] = 0
    return inputs(ctx, seed, counts), counts


def worst_case_inputs(ctx, seed):
    """-> (inputs of tokens_of(seed), num_worst_tokens: every token of every rank)."""
    counts = tokens_of(ctx, seed)
    return inputs(ctx, seed, counts), sum(counts)


def cuda(t, ctx):
    return None if t is None else t.to(ctx.device)


def layout_and_dispatch(ctx, all_inputs, internode, experts=E, with_topk=True, with_weights=True, fp8_scales=0,
                        scales_layout=None, **kwargs):
    """Runs layout + dispatch of this rank's inputs; -> (dispatch outputs, the reference). scales_layout: a
    function that gives FP8 scales other strides (e.g. column_major). Internode, the dispatch gets the layout's
    num_tokens_per_rdma_rank; intranode, the layout must give none."""
    mine = all_inputs[ctx.rank]
    idx = cuda(mine.topk_idx, ctx)
    ntr, nrr, nte, itr, _ = ctx.buffer.get_dispatch_layout(idx, experts)
    if internode:
        per_domain = {"num_tokens_per_rdma_rank": nrr}
    else:
        assert nrr is None
        per_domain = {}
    x = cuda(mine.x, ctx)
    if fp8_scales:
        x = (cuda(_ref.as_fp8(mine.x), ctx), cuda(_ref.make_scales(7, ctx.rank, mine.x.shape[0], fp8_scales), ctx))
        if scales_layout is not None:
            x = (x[0], scales_layout(x[1]))
    out = ctx.buffer.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte if with_topk else None,
        topk_idx=idx if with_topk else None, topk_weights=cuda(mine.topk_weights, ctx) if with_weights else None,
        **per_domain, **kwargs)
    ref = _ref.dispatch([i.topk_idx for i in all_inputs],
                        [i.topk_weights if with_weights else None for i in all_inputs], ctx.rank, experts,
                        kwargs.get("expert_alignment", 1))
    return out, ref


def async_layout_and_dispatch(ctx, mine, internode):
    """Layout after a captured event, then dispatch after the layout's event, both async and allocated on the
    comm stream (the layout's event is a real one), then a matmul in the dispatch's overlap window; -> (x on the
    device, the dispatch outputs, the matmul's [64, 64] result: 64 everywhere)."""
    import epx
    idx = cuda(mine.topk_idx, ctx)
    before = epx.Buffer.capture()
    ntr, nrr, nte, itr, event = ctx.buffer.get_dispatch_layout(idx, E, previous_event=before, async_finish=True,
                                                               allocate_on_comm_stream=True)
    assert isinstance(event, epx.EventOverlap) and event.event is not None
    per_domain = {"num_tokens_per_rdma_rank": nrr} if internode else {}
    x = cuda(mine.x, ctx)
    out = ctx.buffer.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
        topk_weights=cuda(mine.topk_weights, ctx), previous_event=event, async_finish=True,
        allocate_on_comm_stream=True, **per_domain)
    with out[5]:  # overlap window: work here runs while the dispatch may still be in flight
        side = torch.ones(64, 64, device=ctx.device) @ torch.ones(64, 64, device=ctx.device)
    return x, out, side


def check_recv_x(recv_x, ref, all_inputs, fp8_scales=0, rows=None):
    if fp8_scales:
        data, scales = recv_x
        want = _ref.gather_rows([_ref.as_fp8(i.x) for i in all_inputs], ref.src, H, torch.float8_e4m3fn)
        want_scales = _ref.gather_rows([_ref.make_scales(7, s, i.x.shape[0], fp8_scales)
                                        for s, i in enumerate(all_inputs)], ref.src, fp8_scales, torch.float32)
        assert_bitwise("recv_x data", data[:rows], want)
        assert_bitwise("recv_x scales", scales[:rows], want_scales)
    else:
        want = _ref.gather_rows([i.x for i in all_inputs], ref.src, all_inputs[0].x.shape[1], torch.bfloat16)
        assert_bitwise("recv_x", recv_x[:rows], want)


def cached_fp8_dispatch(ctx, mine, handle):
    """Cached FP8 dispatch of new data over the handle's routing: x scaled by -2, scales of seed 8."""
    x2 = _ref.as_fp8(_ref.scale_rows(mine.x, -2.0))
    s2 = _ref.make_scales(8, ctx.rank, mine.x.shape[0], H // 128)
    return ctx.buffer.dispatch((cuda(x2, ctx), cuda(s2, ctx)), handle=handle)


def check_cached_fp8(cached, ref, all_inputs):
    """cached_fp8_dispatch's outputs: only recv_x, bit for bit."""
    assert cached[1:5] == (None, None, None, None)
    want = _ref.gather_rows([_ref.as_fp8(_ref.scale_rows(i.x, -2.0)) for i in all_inputs], ref.src, H,
                            torch.float8_e4m3fn)
    assert_bitwise("cached fp8 data", cached[0][0], want)
    want_s = _ref.gather_rows([_ref.make_scales(8, s, i.x.shape[0], H // 128) for s, i in enumerate(all_inputs)],
                              ref.src, H // 128, torch.float32)
    assert_bitwise("cached fp8 scales", cached[0][1], want_s)


def column_major(scales):
    """[T, S] scales with strides (1, T), as DeepGEMM-style grouped GEMMs keep them: dispatch reads them in place."""
    return scales.T.contiguous().T


def dispatch_fp8_column_major_scales(ctx, internode):
    """Column-major scales in normal, cached and worst-case dispatch, bit for bit; the received scales are
    row-major [N, S] (contiguous), as deep_ep returns them. Every collective call comes before the checks."""
    S = H // 128
    all_inputs, worst = worst_case_inputs(ctx, 22)
    mine = all_inputs[ctx.rank]
    (recv_x, recv_idx, _, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs, internode, fp8_scales=S,
                                                                             scales_layout=column_major)
    s2 = column_major(cuda(_ref.make_scales(8, ctx.rank, mine.x.shape[0], S), ctx))
    cached = ctx.buffer.dispatch((cuda(_ref.as_fp8(mine.x), ctx), s2), handle=handle)[0]
    (worst_x, *_), _ = layout_and_dispatch(ctx, all_inputs, internode, fp8_scales=S, scales_layout=column_major,
                                           num_worst_tokens=worst)

    assert s2.stride() == (1, mine.x.shape[0])
    check_recv_x(recv_x, ref, all_inputs, fp8_scales=S)
    assert recv_x[1].is_contiguous() and tuple(recv_x[1].shape) == (len(ref.src), S)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert per_expert == ref.per_expert
    want_s = _ref.gather_rows([_ref.make_scales(8, s, i.x.shape[0], S) for s, i in enumerate(all_inputs)],
                              ref.src, S, torch.float32)
    assert_bitwise("cached column-major scales", cached[1], want_s)
    assert cached[1].is_contiguous()
    assert tuple(worst_x[1].shape) == (worst, S) and worst_x[1].is_contiguous()
    check_recv_x(worst_x, ref, all_inputs, fp8_scales=S, rows=len(ref.src))


def expert_outputs(ctx, recv_x):
    """Stand-in expert: rank j scales its rows by (1 + j / 4); bit-reproducible on the reference side."""
    return _ref.scale_rows(recv_x, 1.0 + ctx.rank / 4)


def two_biases(ctx, mine, seed):
    """Two [T, H] BF16 biases for this rank's T tokens."""
    T = mine.x.shape[0]
    g = _ref.generator(seed, ctx.rank, salt=3)
    b0 = torch.randn(T, H, generator=g).to(torch.bfloat16)
    b1 = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return b0, b1
