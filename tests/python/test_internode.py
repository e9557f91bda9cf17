"""epx.Buffer's internode (hierarchical) mode on 2 GPUs, as 2 NVLink domains of 1 GPU (EPX_NUM_NVL_RANKS=1) and as
1 domain of 2 forced through the internode kernels (EPX_FORCE_INTERNODE=1), and on 4 GPUs as 2 domains of 2,
against the torch reference (_ref.py): the per-domain layout counts, dispatch (bit-exact) with deep_ep's 10-tuple
handle, element by element, cached and worst-case dispatch, FP8, combine in the two-level and the flat order
(bit-identical), biases, a small config, async and previous-event variants. Each case runs on every rank (see
_dist.py). Skipped without the GPUs or without a libepx built with NVSHMEM.

The two combine orders give different bits only where a domain has several receiving ranks: at 2 x 1 they agree
(each partial is its one row), at 1 x 2 they differ with biases, at 2 x 2 in general."""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import _dist  # noqa: E402
import _ref  # noqa: E402
from _common import Ctx, assert_bitwise  # noqa: E402
from _high_throughput import (E, H, H_MAX, async_layout_and_dispatch, cached_fp8_dispatch,  # noqa: E402
                              check_cached_fp8, check_recv_x, cuda, dispatch_fp8_column_major_scales,
                              expert_outputs, inputs, inputs_without_rank0, tokens_of, two_biases, worst_case_inputs)
from _high_throughput import layout_and_dispatch as layout_and_dispatch_in  # noqa: E402

SMALL = None       # 2 channels, small NVLink sub-rings, network rings of 4 chunks of 2 records (built in setup)


def setup(rank, world):
    import epx
    global SMALL
    SMALL = epx.Config(4, 4, 32, 2, 8)
    configs = [epx.Buffer.get_dispatch_config(world), epx.Buffer.get_combine_config(world), SMALL]
    # The hints read the split from EPX_NUM_NVL_RANKS / EPX_FORCE_INTERNODE, as the Buffer does.
    nvl_bytes = max(c.get_nvl_buffer_size_hint(H_MAX * 2, world) for c in configs)
    rdma_bytes = max(c.get_rdma_buffer_size_hint(H_MAX * 2, world) for c in configs)
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes)
    buffer.set_timeout(30.0)
    G = int(os.environ.get("EPX_NUM_NVL_RANKS", world))  # the test runs on one host: all ranks otherwise
    return Ctx(rank, world, torch.device("cuda", rank), buffer, {"G": G})


def teardown(ctx):
    ctx.buffer.destroy()


# ---- helpers ----------------------------------------------------------------------------------------------------
def in_ranks_of(all_inputs, world):
    return [_ref.layout(i.topk_idx, E, world)[2] for i in all_inputs]


def layout_and_dispatch(ctx, all_inputs, **kwargs):
    """The shared layout + dispatch (_high_throughput.py) with the internode layout: the per-domain counts too."""
    return layout_and_dispatch_in(ctx, all_inputs, internode=True, **kwargs)


def check_handle(ctx, handle, all_inputs, ref, num_channels, worst=0):
    """deep_ep's internode handle: shapes and dtypes, then every element against the reference."""
    R, G = ctx.world, ctx.extra["G"]
    D, T, N = R // G, all_inputs[ctx.rank].x.shape[0], len(ref.src)
    want = _ref.internode_handle(in_ranks_of(all_inputs, R), ctx.rank, G, num_channels)
    rows, rdma_rows = (worst, worst) if worst else (N, want[8].shape[0])
    assert isinstance(handle, tuple) and len(handle) == 10
    shapes = [(torch.bool, (T, R)), (torch.int32, (D, num_channels)), (torch.int32, (R, num_channels)),
              (torch.int32, (D, num_channels)), (torch.int32, (D,)), (torch.int32, (R, num_channels)),
              (torch.int32, (R,)), (torch.uint8, (rows, 8)), (torch.int32, (T, D)), (torch.int32, (rdma_rows, G))]
    for i, (t, (dtype, shape)) in enumerate(zip(handle, shapes)):
        assert t.dtype == dtype and tuple(t.shape) == shape, (i, t.dtype, tuple(t.shape), dtype, shape)
    # Element 6: rows of recv_x from source ranks 0..s (inclusive), the source-major order of recv_x.
    per_source = [sum(1 for s, _ in ref.src if s == j) for j in range(R)]
    assert handle[6].cpu().tolist() == torch.tensor(per_source).cumsum(0).tolist()
    names = ["rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
             "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum"]
    for i, name in enumerate(names, start=1):
        assert_bitwise(f"handle[{i}] {name}", handle[i], want[i - 1])
    meta = handle[7].view(torch.int32)  # [rows, 2]: source domain, mask of this domain's receiving ranks
    assert_bitwise("handle[7] recv_src_meta", meta[:N], want[6])
    if worst:
        assert bool((meta[N:, 0] == -1).all()), "padding rows of recv_src_meta have source domain -1"
    assert_bitwise("handle[8] send_rdma_head", handle[8], want[7])
    assert_bitwise("handle[9] send_nvl_head", handle[9][:want[8].shape[0]], want[8])


def combine_reference(ctx, all_inputs, reduction="two_level", biases=()):
    mine = all_inputs[ctx.rank]
    in_rank = _ref.layout(mine.topk_idx, E, ctx.world)[2]
    rows = [_ref.scale_rows(mine.x, 1.0 + j / 4) for j in range(ctx.world)]
    if reduction == "flat":
        return _ref.combine(rows, in_rank, biases)
    return _ref.combine_two_level(rows, in_rank, ctx.extra["G"], biases)


# The cases make their collective calls before their checks, so that a mismatch on one rank does not leave the
# others waiting in a call it never makes.
def combine_orders(ctx, y, handle, biases=(), **kwargs):
    """-> combined_x in the default order (two-level), explicitly two-level, and flat."""
    bias = tuple(cuda(b, ctx) for b in biases) or None
    return tuple(ctx.buffer.combine(y, handle, bias=bias, reduction=r, **kwargs)[0]
                 for r in (None, "two_level", "flat"))


def check_orders(ctx, combined, all_inputs, biases=()):
    default, two_level, flat = combined
    assert_bitwise("combined_x (default: two-level)", default, combine_reference(ctx, all_inputs, "two_level", biases))
    assert_bitwise("combined_x (two_level)", two_level, default)
    assert_bitwise("combined_x (flat)", flat, combine_reference(ctx, all_inputs, "flat", biases))


def check_combine_orders(ctx, y, handle, all_inputs, biases=(), **kwargs):
    check_orders(ctx, combine_orders(ctx, y, handle, biases, **kwargs), all_inputs, biases)


# ---- cases ---------------------------------------------------------------------------------------------------------
def case_mode(ctx):
    buf, G = ctx.buffer, ctx.extra["G"]
    assert buf.is_internode_available()
    assert buf.get_num_rdma_ranks() == ctx.world // G and buf.get_rdma_rank() == ctx.rank // G
    assert buf.get_root_rdma_rank(True) == ctx.rank % G and buf.get_root_rdma_rank(False) == 0
    assert buf.get_local_device_id() == ctx.rank


def case_layout(ctx):
    all_inputs = inputs(ctx, 1, tokens_of(ctx, 1), empty_prob=0.3)
    idx = cuda(all_inputs[ctx.rank].topk_idx, ctx)
    ntr, nrr, nte, itr, event = ctx.buffer.get_dispatch_layout(idx, E)
    want = _ref.layout(all_inputs[ctx.rank].topk_idx, E, ctx.world)
    assert event.event is None
    assert_bitwise("num_tokens_per_rank", ntr, want[0])
    assert_bitwise("num_tokens_per_expert", nte, want[1])
    assert_bitwise("is_token_in_rank", itr, want[2])
    G = ctx.extra["G"]
    D = ctx.world // G
    if D == 1:
        assert nrr is None
    else:
        T = want[2].shape[0]
        assert_bitwise("num_tokens_per_rdma_rank", nrr, want[2].view(T, D, G).any(2).sum(0).to(torch.int32))


def case_dispatch_combine_bf16(ctx):
    all_inputs = inputs(ctx, 2, tokens_of(ctx, 2))
    (recv_x, recv_idx, recv_w, per_expert, handle, event), ref = layout_and_dispatch(ctx, all_inputs)
    y = expert_outputs(ctx, recv_x)
    combined = combine_orders(ctx, y, handle)
    weights = {r: ctx.buffer.combine(y, handle, topk_weights=recv_w, reduction=r)[1] for r in ("two_level", "flat")}
    again, _, _ = ctx.buffer.combine(y, handle)

    check_orders(ctx, combined, all_inputs)
    assert event.event is None
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert_bitwise("recv_topk_weights", recv_w, ref.recv_topk_weights)
    assert per_expert == ref.per_expert, (per_expert, ref.per_expert)
    check_handle(ctx, handle, all_inputs, ref, ctx.buffer.get_dispatch_config(ctx.world).num_sms // 2)
    mine = all_inputs[ctx.rank]
    in_rank = _ref.layout(mine.topk_idx, E, ctx.world)[2]
    # Rank j sends back the weights it received: the source weight where the expert is on j, else 0. Summed flat
    # in either order.
    L = E // ctx.world
    per_rank_w = [torch.where(mine.topk_idx // L == j, mine.topk_weights, torch.zeros_like(mine.topk_weights))
                  for j in range(ctx.world)]
    for reduction, combined_w in weights.items():
        assert_bitwise(f"combined_topk_weights ({reduction})", combined_w, _ref.combine_weights(per_rank_w, in_rank))
    # Deterministic: the same call gives the same bits.
    assert_bitwise("combined_x (second run)", again, combine_reference(ctx, all_inputs))


def case_dispatch_fp8(ctx):
    all_inputs = inputs(ctx, 3, tokens_of(ctx, 3))
    (recv_x, recv_idx, _, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs, fp8_scales=H // 128)
    cached = cached_fp8_dispatch(ctx, all_inputs[ctx.rank], handle)
    assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn
    check_recv_x(recv_x, ref, all_inputs, fp8_scales=H // 128)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert per_expert == ref.per_expert
    check_cached_fp8(cached, ref, all_inputs)


def case_dispatch_fp8_column_major_scales(ctx):
    """Column-major FP8 scales in normal, cached and worst-case dispatch (_high_throughput.py)."""
    dispatch_fp8_column_major_scales(ctx, internode=True)


def case_cached_dispatch_bf16(ctx):
    all_inputs = inputs(ctx, 8, tokens_of(ctx, 8))
    (_, _, _, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
    new = [[_ref.scale_rows(i.x, 3.0 + step) for i in all_inputs] for step in range(2)]
    outs = [ctx.buffer.dispatch(cuda(n[ctx.rank], ctx), handle=handle) for n in new]
    # The handle is unchanged by the cached dispatches: combine still sums in both orders.
    recv, *_ = ctx.buffer.dispatch(cuda(all_inputs[ctx.rank].x, ctx), handle=handle)
    check_combine_orders(ctx, expert_outputs(ctx, recv), handle, all_inputs)
    for step, (n, (recv, a, b, c, d, event)) in enumerate(zip(new, outs)):
        assert (a, b, c, d) == (None, None, None, None) and event.event is None
        assert_bitwise(f"cached recv_x step {step}", recv, _ref.gather_rows(n, ref.src, H, torch.bfloat16))


def case_worst_case_mode(ctx):
    all_inputs, worst = worst_case_inputs(ctx, 7)
    (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(ctx, all_inputs,
                                                                               num_worst_tokens=worst)
    N = len(ref.src)
    cached = ctx.buffer.dispatch(cuda(all_inputs[ctx.rank].x, ctx), handle=handle)[0]
    check_combine_orders(ctx, expert_outputs(ctx, recv_x), handle, all_inputs)
    assert recv_x.shape[0] == worst and per_expert == []
    check_handle(ctx, handle, all_inputs, ref, ctx.buffer.get_dispatch_config(ctx.world).num_sms // 2, worst=worst)
    check_recv_x(recv_x, ref, all_inputs, rows=N)
    assert_bitwise("recv_topk_idx", recv_idx[:N], ref.recv_topk_idx)
    assert bool((recv_idx[N:] == -1).all()), "padding rows must have no experts"
    assert bool((recv_w[N:] == 0).all())
    assert cached.shape[0] == worst
    check_recv_x(cached, ref, all_inputs, rows=N)


def case_combine_biases(ctx):
    all_inputs = inputs(ctx, 9, tokens_of(ctx, 9))
    (recv_x, _, _, _, handle, _), _ = layout_and_dispatch(ctx, all_inputs)
    b0, b1 = two_biases(ctx, all_inputs[ctx.rank], 9)
    y = expert_outputs(ctx, recv_x)
    one, two = (combine_orders(ctx, y, handle, biases) for biases in ((b0,), (b0, b1)))
    check_orders(ctx, one, all_inputs, (b0,))
    check_orders(ctx, two, all_inputs, (b0, b1))


def case_small_config_and_wide_rows(ctx):
    all_inputs = inputs(ctx, 12, tokens_of(ctx, 12, base=300), hidden=H_MAX)
    (recv_x, _, _, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs, config=SMALL)
    # combine's default config takes the dispatch's num_sms from the handle; SMALL itself works too
    y = expert_outputs(ctx, recv_x)
    default_config, small = combine_orders(ctx, y, handle), combine_orders(ctx, y, handle, config=SMALL)
    check_orders(ctx, default_config, all_inputs)
    check_orders(ctx, small, all_inputs)
    assert handle[1].shape[1] == SMALL.num_sms // 2
    check_handle(ctx, handle, all_inputs, ref, SMALL.num_sms // 2)
    check_recv_x(recv_x, ref, all_inputs)


def case_no_topk(ctx):
    all_inputs = inputs(ctx, 5, tokens_of(ctx, 5))
    (recv_x, recv_idx, recv_w, per_expert, handle, _), ref = layout_and_dispatch(
        ctx, all_inputs, with_topk=False, with_weights=False)
    combined, combined_w, _ = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle)
    assert recv_idx is None and recv_w is None and per_expert == []
    check_recv_x(recv_x, ref, all_inputs)
    assert combined_w is None
    assert_bitwise("combined_x", combined, combine_reference(ctx, all_inputs))


def case_async_and_previous_event(ctx):
    import epx
    all_inputs = inputs(ctx, 10, tokens_of(ctx, 10))
    mine = all_inputs[ctx.rank]
    x, (recv_x, recv_idx, _, _, handle, _), side = async_layout_and_dispatch(ctx, mine, internode=True)
    combined, _, event = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, previous_event=epx.Buffer.capture(),
                                            async_finish=True)
    event.current_stream_wait()
    # async without allocate_on_comm_stream, previous event from an earlier async op
    cached, _, _, _, _, event = ctx.buffer.dispatch(x, handle=handle, async_finish=True)
    flat, _, event = ctx.buffer.combine(expert_outputs(ctx, recv_x), handle, previous_event=event, async_finish=True,
                                        reduction="flat")
    event.current_stream_wait()
    ref = _ref.dispatch([i.topk_idx for i in all_inputs], [i.topk_weights for i in all_inputs], ctx.rank, E)
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_idx", recv_idx, ref.recv_topk_idx)
    assert_bitwise("combined_x (async)", combined, combine_reference(ctx, all_inputs))
    check_recv_x(cached, ref, all_inputs)
    assert_bitwise("combined_x (chained events, flat)", flat, combine_reference(ctx, all_inputs, "flat"))
    assert float(side[0, 0]) == 64.0


def case_zero_tokens_on_rank0(ctx):
    all_inputs, counts = inputs_without_rank0(ctx, 11)
    (recv_x, _, recv_w, _, handle, _), ref = layout_and_dispatch(ctx, all_inputs)
    y = expert_outputs(ctx, recv_x)
    combined, _, _ = ctx.buffer.combine(y, handle, topk_weights=recv_w)
    check_combine_orders(ctx, y, handle, all_inputs)
    assert combined.shape == (counts[ctx.rank], H)
    check_recv_x(recv_x, ref, all_inputs)
    assert_bitwise("recv_topk_weights", recv_w, ref.recv_topk_weights)
    check_handle(ctx, handle, all_inputs, ref, ctx.buffer.get_dispatch_config(ctx.world).num_sms // 2)


CASES = [name for name in list(globals()) if name.startswith("case_")]


# ---- pytest side ---------------------------------------------------------------------------------------------------
# (ranks, NVLink domain size G): 2 domains of 1 GPU, 1 domain of 2 forced through the internode kernels, 2 x 2.
SPLITS = [(2, 1), (2, 2), (4, 2)]


@pytest.fixture(scope="module", params=SPLITS, ids=lambda s: f"{s[0] // s[1]}x{s[1]}")
def results(request):
    world, G = request.param
    _dist.require_gpus(world)
    import epx
    if not epx.lib().epx_built_with_nvshmem():
        pytest.skip(f"the internode mode needs a libepx built with NVSHMEM ({epx.lib().path} is not)")
    with pytest.MonkeyPatch.context() as env:  # the spawned ranks inherit the split
        env.delenv("EPX_NUM_NVL_RANKS", raising=False)
        env.delenv("EPX_FORCE_INTERNODE", raising=False)
        if G < world:
            env.setenv("EPX_NUM_NVL_RANKS", str(G))
        else:
            env.setenv("EPX_FORCE_INTERNODE", "1")
        return _dist.run_cases(os.path.abspath(__file__), CASES, world, timeout_s=300)


@pytest.mark.parametrize("case", CASES)
def test_internode(results, case):
    results.check(case)
