"""FP8 scales at any strides in the high-throughput dispatch, on a CPU (a stub library and fake streams, as in
test_streams_cpu.py): what epx.Buffer passes through the C ABI. For every scale of every token, the address that
epx_dispatch_args' pointer and strides give (epx.h: element strides, 0 and 0 meaning row-major) must be that of the
caller's tensor element: the kernels read the scales in place, so no copy may come between. The received scales
are row-major [N, S] whatever the input's strides, as deep_ep allocates them. The GPU suites check the data."""

import pytest

torch = pytest.importorskip("torch")
from _fake_cuda import FakeCuda, fake_buffer, struct_of, stub_library  # noqa: E402

R, E, T, H, K = 2, 8, 6, 512, 2
S = H // 128
CALLS = ("epx_notify_dispatch", "epx_dispatch_sized", "epx_dispatch", "epx_dispatch_cached")


@pytest.fixture
def env():
    """-> (a Buffer over the stub library, the list of (call name, args struct, outputs struct or None) seen)."""
    seen = []

    def wrap(name, fn):
        if name not in CALLS:
            return fn

        def spy(*args):
            seen.append((name, _copy(struct_of(args[1])),
                         _copy(struct_of(args[4])) if name != "epx_notify_dispatch" else None))
            return fn(*args)
        return spy
    try:
        with FakeCuda() as cuda:
            with stub_library(wrap):
                yield fake_buffer(cuda, R), seen
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))


def _copy(struct):
    return {name: getattr(struct, name) for name, _ in struct._fields_}


def layout_args(tokens=T):
    return dict(num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                is_token_in_rank=torch.zeros(tokens, R, dtype=torch.bool),
                num_tokens_per_expert=torch.zeros(E, dtype=torch.int32),
                topk_idx=torch.zeros(tokens, K, dtype=torch.int64), topk_weights=torch.zeros(tokens, K))


def fp8(tokens=T):
    return torch.zeros(tokens, H, dtype=torch.float8_e4m3fn)


def row_major(tokens=T, dtype=torch.float32):
    return torch.arange(tokens * S, dtype=torch.float32).view(tokens, S).to(dtype)


def column_major(tokens=T, dtype=torch.float32):
    return row_major(tokens, dtype).T.contiguous().T  # what DeepGEMM-style grouped GEMMs keep: strides (1, T)


def padded(tokens=T):
    return torch.zeros(tokens, 2 * S + 3)[:, :2 * S:2]  # strides (2S + 3, 2): gaps between tokens and scales


def transposed_view(tokens=T):
    return torch.zeros(S, tokens).T  # column-major by transposing a [S, T] tensor, no copy at all


def addressed(args, tokens, scales):
    """Asserts that the C struct addresses every element of `scales` where it is (epx.h's rule)."""
    st, sg = args["x_scales_stride_token"], args["x_scales_stride_group"]
    assert st >= 0 and sg >= 0
    if st == 0 and sg == 0:
        st, sg = args["num_scales"], 1
    assert args["num_scales"] == scales.shape[1]
    assert (args["x_scales"] or 0) == scales.data_ptr(), "the kernels must read the caller's tensor, not a copy"
    for t in range(tokens):
        for g in range(scales.shape[1]):
            assert args["x_scales"] + 4 * (t * st + g * sg) == scales[t, g].data_ptr(), (t, g, st, sg)


LAYOUTS = [row_major, column_major, padded, transposed_view]


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__)
def test_dispatch_passes_the_strides_of_the_scales(env, make):
    buf, seen = env
    scales = make()
    (recv_x, recv_scales), *_ = buf.dispatch((fp8(), scales), **layout_args())
    assert [name for name, _, _ in seen] == ["epx_notify_dispatch", "epx_dispatch"]
    for _, args, _ in seen:
        addressed(args, T, scales)
    outs = seen[-1][2]
    # deep_ep's recv_x_scales: torch.empty({num_recv_tokens, num_scales}, x_scales.options()), row-major.
    assert recv_scales.dtype == scales.dtype and tuple(recv_scales.shape) == (T, S) and recv_scales.is_contiguous()
    assert outs["recv_x_scales"] == recv_scales.data_ptr()


def test_row_major_scales_go_as_zero_strides(env):
    """Callers that predate the strides pass 0 and 0: contiguous scales keep doing so."""
    buf, seen = env
    buf.dispatch((fp8(), row_major()), **layout_args())
    assert all((a["x_scales_stride_token"], a["x_scales_stride_group"]) == (0, 0) for _, a, _ in seen)
    seen.clear()
    buf.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), **layout_args())  # no scales: 0 and 0 as well
    assert all((a["x_scales_stride_token"], a["x_scales_stride_group"], a["num_scales"]) == (0, 0, 0)
               for _, a, _ in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=["float32", "int32"])
def test_int32_scales_and_worst_case_mode(env, dtype):
    buf, seen = env
    scales = column_major(dtype=dtype)
    (_, recv_scales), *_ = buf.dispatch((fp8(), scales), **layout_args(), num_worst_tokens=64)
    addressed(seen[-1][1], T, scales)
    assert seen[-1][1]["num_worst_tokens"] == 64
    assert recv_scales.dtype == dtype and tuple(recv_scales.shape) == (64, S) and recv_scales.is_contiguous()


def test_cached_dispatch_follows_each_calls_strides(env):
    """Cached dispatch reuses its argument struct between calls: the strides must still be each call's."""
    buf, seen = env
    (_, _), _, _, _, handle, _ = buf.dispatch((fp8(), row_major()), **layout_args())
    for make in [column_major, column_major, row_major, padded, transposed_view, row_major]:
        seen.clear()
        scales = make()
        (_, recv_scales), *_ = buf.dispatch((fp8(), scales), handle=handle)
        [(name, args, outs)] = seen
        assert name == "epx_dispatch_cached"
        addressed(args, T, scales)
        assert recv_scales.is_contiguous() and tuple(recv_scales.shape) == (T, S)
        assert outs["recv_x_scales"] == recv_scales.data_ptr()


@pytest.mark.parametrize("tokens", [0, 1])
def test_unused_strides_of_size_one_dimensions(env, tokens):
    """A dimension of size 0 or 1 may have any stride in torch (it is never used): what goes to the library
    must still be valid there (no zero stride with several elements)."""
    buf, seen = env
    for scales in (column_major(tokens), torch.zeros(S, tokens).T, torch.zeros(tokens, 1).T.contiguous().T):
        seen.clear()
        buf.dispatch((fp8(tokens), scales), **layout_args(tokens))
        for _, args, _ in seen:
            addressed(args, tokens, scales)
            strides = args["x_scales_stride_token"], args["x_scales_stride_group"]
            assert strides == (0, 0) or min(strides) >= 1, strides


def test_expanded_scales_are_refused(env):
    buf, seen = env
    for scales in (torch.ones(1, S).expand(T, S), torch.ones(T, 1).expand(T, S)):
        with pytest.raises(ValueError, match="zero stride"):
            buf.dispatch((fp8(), scales), **layout_args())
    assert not seen
