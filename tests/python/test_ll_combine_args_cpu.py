"""What low_latency_combine passes to the library, on a CPU (fake streams, a stub library; see _fake_cuda.py): the
short path a call takes after a call on the same handle passed every check carries the reduction and the LogFMT
switch of the call it serves, whatever the calls before it used."""

import pytest

torch = pytest.importorskip("torch")
from _fake_cuda import FakeCuda, fake_buffer, struct_of, stub_library  # noqa: E402

R, E, T, H, K, M = 2, 8, 6, 128, 2, 8
FLAT, RANK = 1, 3  # EPX_REDUCE_FLAT, EPX_REDUCE_RANK


@pytest.fixture
def combine_args():
    """-> (a Buffer on the stub library, the (reduction, use_logfmt) of every epx_ll_combine call seen)."""
    seen = []
    try:
        with FakeCuda() as cuda:
            def wrap(name, fn):
                if name != "epx_ll_combine":
                    return fn

                def spy(ptr, args, handle, combined_x, phases, buffer_set, stream):
                    a = struct_of(args)
                    seen.append((a.reduction, a.use_logfmt))
                    return fn(ptr, args, handle, combined_x, phases, buffer_set, stream)
                return spy

            with stub_library(wrap):
                yield fake_buffer(cuda, R), seen
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))


def test_reduction_follows_each_call(combine_args):
    buf, seen = combine_args
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.arange(T * K).remainder(E).view(T, K)
    w = torch.ones(T, K)
    handle = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, topk_weights=w)[2]
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16)
    calls = [None, "rank", "rank", None, "flat", "flat", "rank", None, None]
    for reduction in calls:
        buf.low_latency_combine(y, idx, w, handle, reduction=reduction)
    assert [s[0] for s in seen] == [RANK if r == "rank" else FLAT for r in calls]
    # LogFMT calls between short-path calls: each call's own switch.
    seen.clear()
    for use_logfmt, reduction in ((True, None), (False, None), (False, "flat"), (True, "flat"), (False, None)):
        buf.low_latency_combine(y, idx, w, handle, use_logfmt=use_logfmt, reduction=reduction)
    assert seen == [(FLAT, True), (FLAT, False), (FLAT, False), (FLAT, True), (FLAT, False)]


def test_short_path_still_rejects(combine_args):
    buf, _ = combine_args
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.arange(T * K).remainder(E).view(T, K)
    w = torch.ones(T, K)
    plain = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)[2]
    weighted = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, topk_weights=w)[2]
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16)
    for _ in range(2):
        buf.low_latency_combine(y, idx, w, weighted, reduction="rank")
    with pytest.raises(TypeError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w.double(), weighted, reduction="rank")
    with pytest.raises(ValueError, match="reduction"):
        buf.low_latency_combine(y, idx, w, weighted, reduction="Rank")
    with pytest.raises(TypeError, match="reduction"):
        buf.low_latency_combine(y, idx, w, weighted, reduction=3)
    with pytest.raises(ValueError, match="use_logfmt"):
        buf.low_latency_combine(y, idx, w, weighted, reduction="rank", use_logfmt=True)
    # The rank order on a handle without weights, right after rank calls on one with them.
    buf.low_latency_combine(y, idx, w, plain)
    with pytest.raises(ValueError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w, plain, reduction="rank")
