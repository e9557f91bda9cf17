"""The internode path of epx.Buffer on a CPU (fake streams, the stub library; see _fake_cuda.py): the arrays a
dispatch allocates and hands the library, deep_ep's 10-tuple handle it returns, the C handle that cached dispatch
and combine rebuild from a tuple, the layout's per-domain counts, combine's reduction argument, and the rank
helpers. The stub does no work: the data is checked by the GPU suite (test_internode.py)."""

import pytest

torch = pytest.importorskip("torch")
from _fake_cuda import FakeCuda, fake_buffer, struct_of, stub_library  # noqa: E402

from epx import _lib  # noqa: E402

R, G, E, T, H, K = 4, 2, 8, 6, 128, 2
D = R // G
C = 12  # channels of the stub's default config (24 SMs)
HANDLE_FIELDS = ("num_ranks", "num_channels", "num_tokens", "num_recv_tokens", "rank_prefix_matrix",
                 "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank",
                 "send_head", "num_domains", "num_nvl_ranks", "num_rdma_recv_tokens", "rdma_channel_prefix_matrix",
                 "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_rank_prefix_sum",
                 "recv_src_meta", "send_rdma_head", "send_nvl_head")
# (name of the call, index of its handle argument, index of its args argument)
SPIED = {"epx_notify_dispatch": (3, 1), "epx_dispatch": (3, 1), "epx_dispatch_cached": (3, 1),
         "epx_combine": (3, 1), "epx_get_dispatch_layout": (None, 2)}


@pytest.fixture
def env():
    """-> (FakeCuda, calls, make_buffer). calls: (name, copy of the handle struct's fields or None, copy of the
    args struct's fields) of every spied call, in order; the structs are copied at the call (Python reuses
    them). make_buffer(**kwargs) makes an internode Buffer of D x G ranks unless told otherwise."""
    calls = []
    try:
        with FakeCuda() as cuda:
            def wrap(name, fn):
                if name not in SPIED:
                    return fn
                h_at, args_at = SPIED[name]

                def spy(*a):
                    h = None if h_at is None else {f: getattr(struct_of(a[h_at]), f) for f in HANDLE_FIELDS}
                    args = struct_of(a[args_at])
                    calls.append((name, h, {f: getattr(args, f) for f, _ in type(args)._fields_}))
                    return fn(*a)
                return spy

            def make_buffer(**kwargs):
                options = dict(num_nvl_ranks=G, internode=True, low_latency_mode=False)
                options.update(kwargs)
                return fake_buffer(cuda, R, **options)

            with stub_library(wrap):
                yield cuda, calls, make_buffer
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))


def layout(buf):
    idx = torch.zeros(T, K, dtype=torch.int64)
    ntr, nrr, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=itr,
                num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(T, K))


def ptr(t):
    return t.data_ptr() or None  # ctypes reads a null c_void_p back as None


def check_handle_shapes(handle, itr, rows, rdma_rows):
    assert isinstance(handle, tuple) and len(handle) == 10
    assert handle[0] is itr
    want = [(torch.bool, (T, R)), (torch.int32, (D, C)), (torch.int32, (R, C)), (torch.int32, (D, C)),
            (torch.int32, (D,)), (torch.int32, (R, C)), (torch.int32, (R,)), (torch.uint8, (rows, 8)),
            (torch.int32, (T, D)), (torch.int32, (rdma_rows, G))]
    for i, (t, (dtype, shape)) in enumerate(zip(handle, want)):
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous(), (i, t.dtype, tuple(t.shape))


def check_struct_matches(h, handle, rows, rdma_rows):
    """The C handle holds the tuple's arrays (deep_ep's names where the C struct has others) and its counts."""
    assert (h["num_ranks"], h["num_channels"], h["num_tokens"], h["num_domains"], h["num_nvl_ranks"]) == (R, C, T, D, G)
    assert (h["num_recv_tokens"], h["num_rdma_recv_tokens"]) == (rows, rdma_rows)
    names = ["is_token_in_rank", "rdma_channel_prefix_matrix", "channel_prefix_matrix",
             "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_channel_prefix_matrix",
             "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head"]
    for name, t in zip(names, handle):
        assert h[name] == ptr(t), name
    assert h["rank_prefix_matrix"] is None and h["recv_src_idx"] is None and h["send_head"] is None


def test_layout_counts_tokens_per_domain(env):
    cuda, calls, make_buffer = env
    args = layout(make_buffer())
    nrr = args["num_tokens_per_rdma_rank"]
    assert nrr.dtype == torch.int32 and tuple(nrr.shape) == (D,)
    assert calls[-1][2]["num_tokens_per_rdma_rank"] == ptr(nrr)
    # One domain (forced internode, or intranode): no per-domain counts, and the library is given none.
    for buf in (make_buffer(num_nvl_ranks=R), make_buffer(num_nvl_ranks=R, internode=False)):
        assert layout(buf)["num_tokens_per_rdma_rank"] is None
        assert calls[-1][2]["num_tokens_per_rdma_rank"] is None


@pytest.mark.parametrize("worst", [0, 11], ids=["counted", "worst-case"])
def test_dispatch_returns_deep_eps_internode_handle(env, worst):
    cuda, calls, make_buffer = env
    buf = make_buffer()
    args = layout(buf)
    x = torch.ones(T, H, dtype=torch.bfloat16)
    calls.clear()
    recv_x, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(x, num_worst_tokens=worst, **args)
    rows = worst or T  # the stub reports T rows and T network records
    check_handle_shapes(handle, args["is_token_in_rank"], rows, rows)
    assert tuple(recv_x.shape) == (rows, H) and tuple(recv_idx.shape) == (rows, K) and recv_w.shape == (rows, K)
    assert event.event is None
    # recv_src_meta is the C array of int32 pairs, viewed as deep_ep's 8-byte rows.
    assert handle[7].untyped_storage().nbytes() == rows * 8
    assert [name for name, _, _ in calls] == ["epx_notify_dispatch", "epx_dispatch"]
    notify_h, dispatch_h = calls[0][1], calls[1][1]
    # notify gets the arrays it fills; recv_src_meta and send_nvl_head are sized by its counts, for the dispatch.
    assert notify_h["recv_src_meta"] is None and notify_h["send_nvl_head"] is None
    assert notify_h["rank_prefix_matrix"] is None and notify_h["send_head"] is None
    for name, t in (("rdma_channel_prefix_matrix", handle[1]), ("channel_prefix_matrix", handle[2]),
                    ("recv_rdma_channel_prefix_matrix", handle[3]), ("recv_rdma_rank_prefix_sum", handle[4]),
                    ("recv_channel_prefix_matrix", handle[5]), ("recv_gbl_rank_prefix_sum", handle[6]),
                    ("send_rdma_head", handle[8])):
        assert notify_h[name] == ptr(t) == dispatch_h[name], name
    assert dispatch_h["recv_src_meta"] == ptr(handle[7]) and dispatch_h["send_nvl_head"] == ptr(handle[9])
    assert calls[1][2]["num_worst_tokens"] == worst


def test_cached_dispatch_and_combine_rebuild_the_c_handle_from_the_tuple(env):
    cuda, calls, make_buffer = env
    buf = make_buffer()
    args = layout(buf)
    x = torch.ones(T, H, dtype=torch.bfloat16)
    _, _, _, _, handle, _ = buf.dispatch(x, **args)
    # A tuple with other row counts than the dispatch's (as a worst-case handle has): the C handle takes its counts
    # from the shapes of recv_src_meta (rows of recv_x) and send_nvl_head (network records).
    rows, rdma_rows = 7, 5
    other = handle[:7] + (torch.zeros(rows, 8, dtype=torch.uint8),) + handle[8:9] + \
        (torch.zeros(rdma_rows, G, dtype=torch.int32),)
    for h, n, n_rdma in ((handle, T, T), (other, rows, rdma_rows)):
        calls.clear()
        recv, a, b, c, d, event = buf.dispatch(x, handle=h)
        assert (a, b, c, d) == (None, None, None, None) and tuple(recv.shape) == (n, H)
        assert [name for name, _, _ in calls] == ["epx_dispatch_cached"]
        check_struct_matches(calls[0][1], h, n, n_rdma)
        assert calls[0][2]["is_token_in_rank"] == ptr(h[0])
        combined, weights, _ = buf.combine(torch.zeros(n, H, dtype=torch.bfloat16), h,
                                           topk_weights=torch.zeros(n, K))
        assert tuple(combined.shape) == (T, H) and tuple(weights.shape) == (T, K)
        check_struct_matches(calls[1][1], h, n, n_rdma)
    with pytest.raises(ValueError, match="x must have shape"):
        buf.combine(torch.zeros(rows + 1, H, dtype=torch.bfloat16), other)


def test_combine_reduction(env):
    cuda, calls, make_buffer = env
    buf = make_buffer()
    x = torch.ones(T, H, dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout(buf))
    for reduction, code in ((None, _lib.EPX_REDUCE_DEFAULT), ("two_level", _lib.EPX_REDUCE_TWO_LEVEL),
                            ("flat", _lib.EPX_REDUCE_FLAT), (None, _lib.EPX_REDUCE_DEFAULT)):
        calls.clear()
        buf.combine(recv_x, handle, reduction=reduction)
        assert calls[0][0] == "epx_combine" and calls[0][2]["reduction"] == code, reduction
    with pytest.raises(ValueError, match="'two_level', 'flat' or None"):
        buf.combine(recv_x, handle, reduction="tree")
    with pytest.raises(TypeError, match="reduction"):
        buf.combine(recv_x, handle, reduction=2)
    # Inside one NVLink domain the order is flat: None and "flat" pass, "two_level" is refused before the launch.
    intra = make_buffer(num_nvl_ranks=R, internode=False)
    recv_x, _, _, _, handle, _ = intra.dispatch(x, **layout(intra))
    assert len(handle) == 6
    for reduction, code in ((None, _lib.EPX_REDUCE_DEFAULT), ("flat", _lib.EPX_REDUCE_FLAT)):
        calls.clear()
        intra.combine(recv_x, handle, reduction=reduction)
        assert calls[0][2]["reduction"] == code
    calls.clear()
    with pytest.raises(ValueError, match="two_level.*flat order"):
        intra.combine(recv_x, handle, reduction="two_level")
    assert not calls


def test_handles_of_the_other_mode_are_refused(env):
    cuda, calls, make_buffer = env
    inter, intra = make_buffer(), make_buffer(num_nvl_ranks=R, internode=False)
    x = torch.ones(T, H, dtype=torch.bfloat16)
    inter_handle = inter.dispatch(x, **layout(inter))[4]
    intra_handle = intra.dispatch(x, **layout(intra))[4]
    with pytest.raises(TypeError, match="10-tuple"):
        inter.dispatch(x, handle=intra_handle)
    with pytest.raises(TypeError, match="6-tuple"):
        intra.combine(torch.zeros(T, H, dtype=torch.bfloat16), inter_handle)
    for i, bad, error, match in ((7, lambda t: t.view(torch.int32), TypeError, r"handle\[7\] \(recv_src_meta\)"),
                                 (9, lambda t: t[:, :1].contiguous(), ValueError, r"handle\[9\] \(send_nvl_head\)"),
                                 (8, lambda t: t[1:], ValueError, r"handle\[8\] \(send_rdma_head\)"),
                                 (3, lambda t: t[:, 1:].contiguous(), ValueError, r"handle\[3\]"),
                                 (6, lambda t: t.long(), TypeError, r"handle\[6\] \(recv_gbl_rank_prefix_sum\)")):
        broken = list(inter_handle)
        broken[i] = bad(broken[i])
        with pytest.raises(error, match=match):
            inter.dispatch(x, handle=tuple(broken))


def test_num_tokens_per_rdma_rank_is_checked(env):
    cuda, calls, make_buffer = env
    buf = make_buffer()
    args = layout(buf)
    x = torch.ones(T, H, dtype=torch.bfloat16)
    buf.dispatch(x, **{**args, "num_tokens_per_rdma_rank": None})  # optional: the library counts on the device
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(x, **{**args, "num_tokens_per_rdma_rank": torch.zeros(D + 1, dtype=torch.int32)})
    with pytest.raises(TypeError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(x, **{**args, "num_tokens_per_rdma_rank": torch.zeros(D, dtype=torch.int64)})


def test_async_dispatch_records_every_handle_tensor(env):
    cuda, calls, make_buffer = env
    buf = make_buffer()
    x = torch.ones(T, H, dtype=torch.bfloat16)
    args = layout(buf)
    *_, handle, event = buf.dispatch(x, async_finish=True, **args)
    assert event.event is not None
    recorded = {id(t) for t, s in cuda.record_stream_calls if s is buf.get_comm_stream()}
    assert all(id(t) in recorded for t in handle)


@pytest.mark.parametrize("rank", range(R))
def test_rank_helpers(env, rank):
    cuda, calls, make_buffer = env
    buf = make_buffer(rank=rank)
    assert buf.is_internode_available()
    assert buf.get_num_rdma_ranks() == D and buf.get_rdma_rank() == rank // G
    assert buf.get_root_rdma_rank(True) == rank % G and buf.get_root_rdma_rank(False) == 0
    intra = make_buffer(rank=rank, num_nvl_ranks=R, internode=False)
    assert not intra.is_internode_available()
    assert intra.get_num_rdma_ranks() == 1 and intra.get_rdma_rank() == 0 and intra.get_root_rdma_rank(True) == rank
