"""Argument checks of epx.Buffer, run on a CPU: a Buffer without a native buffer (Buffer._unlaunched) whose
device is the CPU. A bad argument must raise TypeError / ValueError (or NotImplementedError); a good call
must get past every check and stop at the first step that would touch CUDA (FailedStateError)."""

import ctypes
import inspect

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
from epx import _lib  # noqa: E402

R = 4
E = 16
T = 10
H = 256
K = 4
CPU = torch.device("cpu")

# Reached the launch: every check passed.
launched = pytest.raises(epx.FailedStateError)


@pytest.fixture
def buf():
    return epx.Buffer._unlaunched(R)


def bf16(*shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


def layout_args():
    return dict(num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                is_token_in_rank=torch.zeros(T, R, dtype=torch.bool),
                num_tokens_per_expert=torch.zeros(E, dtype=torch.int32),
                topk_idx=torch.zeros(T, K, dtype=torch.int64), topk_weights=torch.zeros(T, K))


def handle(num_recv=7, channels=12, tokens=T):
    return (torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, channels, dtype=torch.int32),
            torch.zeros(R, channels, dtype=torch.int32), torch.zeros(num_recv, dtype=torch.int32),
            torch.zeros(tokens, R, dtype=torch.bool), torch.zeros(tokens, R, dtype=torch.int32))


def misaligned_bf16(rows, cols):
    return torch.zeros(rows * cols + 1, dtype=torch.bfloat16)[1:].view(rows, cols)


# ---- deep_ep API surface -----------------------------------------------------------------------------------------
EXPECTED_SIGNATURES = {
    "__init__": "self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, "
                "allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False, "
                "explicitly_destroy=False, enable_shrink=False, comm=None, num_recv_bytes=0",
    "get_dispatch_layout": "self, topk_idx, num_experts, previous_event=None, async_finish=False, "
                           "allocate_on_comm_stream=False",
    "dispatch": "self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, "
                "is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, "
                "expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False, "
                "allocate_on_comm_stream=False, outputs_in_buffer=False",
    "combine": "self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, "
               "allocate_on_comm_stream=False, reduction=None, inputs_in_buffer=False",
    "low_latency_dispatch": "self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
                            "cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, "
                            "use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, "
                            "return_recv_hook=False, topk_weights=None",
    "low_latency_combine": "self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, "
                           "async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None, "
                           "reduction=None",
    "get_next_low_latency_combine_buffer": "self, handle",
    "clean_low_latency_buffer": "self, num_max_dispatch_tokens_per_rank, hidden, num_experts",
    "get_local_buffer_tensor": "self, dtype, size=None, offset=0, use_rdma_buffer=False",
    "get_comm_stream": "self",
    "destroy": "self",
    "set_num_sms": "new_num_sms",
    "capture": "",
    "get_dispatch_config": "num_ranks",
    "get_combine_config": "num_ranks",
    "get_low_latency_rdma_size_hint": "num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SIGNATURES))
def test_signature_follows_deep_ep(name):
    params = inspect.signature(getattr(epx.Buffer, name)).parameters.values()
    text = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
    assert text == EXPECTED_SIGNATURES[name]


def test_package_names():
    assert epx.topk_idx_t is torch.int64
    assert epx.EventOverlap is not None and epx.Buffer is not None
    with pytest.raises(AttributeError):
        epx.not_a_name  # noqa: B018


# ---- construction and static helpers --------------------------------------------------------------------------
def test_constructor_checks_come_first():
    with pytest.raises(ValueError, match="group"):
        epx.Buffer()
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        epx.Buffer(object(), num_nvl_bytes=-1)
    with pytest.raises(TypeError, match="num_rdma_bytes"):
        epx.Buffer(object(), num_rdma_bytes=1.5)


def test_static_configs_and_num_sms():
    assert epx.Buffer.get_dispatch_config(R).num_sms == epx.Buffer.get_combine_config(R).num_sms
    for kind, get in (("dispatch", epx.Buffer.get_dispatch_config), ("combine", epx.Buffer.get_combine_config)):
        for r in (R, 16):  # the library's defaults, RDMA fields included
            assert get(r) == epx.Config.from_c(_lib.default_config(kind, r))
            raw = _lib.default_config(kind, r)
            assert get(r).num_max_rdma_chunked_send_tokens == raw.num_max_rdma_send_tokens
            assert get(r).num_max_rdma_chunked_recv_tokens == raw.num_max_rdma_recv_tokens
    with pytest.raises(ValueError, match="even"):
        epx.Buffer.set_num_sms(7)
    saved = epx.Buffer.num_sms
    try:
        epx.Buffer.set_num_sms(10)
        assert epx.Buffer.get_dispatch_config(R).num_sms == 10
        assert epx.Buffer.get_combine_config(R).num_sms == 10
    finally:
        epx.Buffer.num_sms = saved
    assert epx.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    with pytest.raises(epx.InvalidArgumentError):
        epx.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 100)


def test_event_overlap_without_event():
    e = epx.EventOverlap()
    with pytest.raises(RuntimeError, match="synchronous"):
        e.current_stream_wait()
    with e:  # a no-op
        pass


def test_local_buffer_tensor_checks():
    """Everything but the pointer is checked before the library is asked for it (the GPU suites check the
    tensor itself)."""
    buf = epx.Buffer._unlaunched(R, num_nvl_bytes=1024, num_rdma_bytes=0)
    for kwargs in (dict(dtype=torch.bfloat16), dict(dtype=torch.float32, size=torch.Size([16, 16])),
                   dict(dtype=torch.int64, size=(2, 3), offset=1024 - 48), dict(dtype=torch.uint8, size=0, offset=1024),
                   dict(dtype=torch.float8_e4m3fn, size=[4, 4], offset=7)):
        with launched:
            buf.get_local_buffer_tensor(**kwargs)
    with pytest.raises(ValueError, match="no low-latency"):
        buf.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
    with pytest.raises(ValueError, match="multiple of the size"):
        buf.get_local_buffer_tensor(torch.float32, offset=2)
    with pytest.raises(ValueError, match="needs 1028 bytes"):
        buf.get_local_buffer_tensor(torch.float32, (257,))
    with pytest.raises(ValueError, match="needs 16 bytes from offset 1016"):
        buf.get_local_buffer_tensor(torch.int64, (2,), offset=1016)
    with pytest.raises(ValueError, match="past the end"):
        buf.get_local_buffer_tensor(torch.uint8, offset=1025)
    with pytest.raises(ValueError, match="offset"):
        buf.get_local_buffer_tensor(torch.uint8, offset=-1)
    with pytest.raises(TypeError, match="dtype"):
        buf.get_local_buffer_tensor("bfloat16")
    with pytest.raises(TypeError, match="size"):
        buf.get_local_buffer_tensor(torch.uint8, size=2.0)
    with pytest.raises(ValueError, match=r"size\[1\]"):
        buf.get_local_buffer_tensor(torch.uint8, size=(2, -1))
    with pytest.raises(TypeError, match="use_rdma_buffer"):
        buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer="yes")
    ll = epx.Buffer._unlaunched(R, num_nvl_bytes=0, num_rdma_bytes=4096)
    with pytest.raises(ValueError, match="no NVLink buffer"):
        ll.get_local_buffer_tensor(torch.uint8)
    with launched:
        ll.get_local_buffer_tensor(torch.uint8, (64, 64), use_rdma_buffer=True)


# ---- layout -----------------------------------------------------------------------------------------------------
def test_layout_checks(buf):
    idx = torch.zeros(T, K, dtype=torch.int64)
    with launched:
        buf.get_dispatch_layout(idx, E)
    with pytest.raises(TypeError, match="topk_idx.*int64"):
        buf.get_dispatch_layout(idx.int(), E)
    with pytest.raises(TypeError, match="torch.Tensor"):
        buf.get_dispatch_layout([[0]], E)
    with pytest.raises(ValueError, match="dimensions"):
        buf.get_dispatch_layout(idx.view(-1), E)
    with pytest.raises(ValueError, match="contiguous"):
        buf.get_dispatch_layout(torch.zeros(K, T, dtype=torch.int64).t(), E)
    with pytest.raises(ValueError, match="device"):
        buf.get_dispatch_layout(idx.to("meta"), E)
    with pytest.raises(ValueError, match="multiple"):
        buf.get_dispatch_layout(idx, E + 1)
    with pytest.raises(TypeError, match="num_experts"):
        buf.get_dispatch_layout(idx, float(E))
    with pytest.raises(ValueError, match="num_topk"):
        buf.get_dispatch_layout(torch.zeros(T, 33, dtype=torch.int64), E)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buf.get_dispatch_layout(idx, E, allocate_on_comm_stream=True)
    with pytest.raises(TypeError, match="previous_event"):
        buf.get_dispatch_layout(idx, E, previous_event="now")


# ---- dispatch ---------------------------------------------------------------------------------------------------
def test_dispatch_accepts_good_arguments(buf):
    with launched:
        buf.dispatch(bf16(T, H), **layout_args())
    fp8 = (torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, H // 128))
    with launched:
        buf.dispatch(fp8, **layout_args(), expert_alignment=128, num_worst_tokens=64)
    for scales in (torch.zeros(T, H // 128).T.contiguous().T,  # column-major, as grouped GEMMs keep them
                   torch.zeros(H // 128, T).T, torch.zeros(T, 5)[:, 1:3],  # a transposed view, a column slice
                   torch.zeros(T, 4, dtype=torch.int32)[:, ::2]):  # packed UE8M0 words at a stride of 2
        with launched:
            buf.dispatch((fp8[0], scales), **layout_args())
    with launched:
        buf.dispatch(bf16(T, H), num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                     is_token_in_rank=torch.zeros(T, R, dtype=torch.bool))
    with launched:
        buf.dispatch(bf16(0, H), **{**layout_args(), "is_token_in_rank": torch.zeros(0, R, dtype=torch.bool),
                                    "topk_idx": torch.zeros(0, K, dtype=torch.int64),
                                    "topk_weights": torch.zeros(0, K)})


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(T, H)), TypeError, "x must have dtype"),
    (dict(x=(bf16(T, H),)), ValueError, "tuple"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T + 1, 2))), ValueError, "scales"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 2, dtype=torch.float16))), TypeError,
     "scales"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 0))), ValueError, "at least one column"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T))), ValueError, "scales"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(1, 2).expand(T, 2))), ValueError,
     "zero stride"),
    (dict(x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 2).T)), ValueError, "scales"),
    (dict(x=bf16(T, 12)), ValueError, "hidden % 8"),
    (dict(x=misaligned_bf16(T, H)), ValueError, "16-byte"),
    (dict(num_tokens_per_rank=None), ValueError, "num_tokens_per_rank"),
    (dict(num_tokens_per_rank=torch.zeros(R + 1, dtype=torch.int32)), ValueError, "num_tokens_per_rank"),
    (dict(is_token_in_rank=torch.zeros(T, R, dtype=torch.uint8)), TypeError, "is_token_in_rank"),
    (dict(is_token_in_rank=torch.zeros(T + 1, R, dtype=torch.bool)), ValueError, "is_token_in_rank"),
    (dict(num_tokens_per_expert=None), ValueError, "num_tokens_per_expert"),
    (dict(num_tokens_per_expert=torch.zeros(E + 1, dtype=torch.int32)), ValueError, "multiple"),
    (dict(topk_weights=torch.zeros(T, K + 1)), ValueError, "topk_weights"),
    (dict(topk_weights=torch.zeros(T, K, dtype=torch.float64)), TypeError, "topk_weights"),
    (dict(topk_idx=None), ValueError, "topk_weights needs topk_idx"),
    (dict(expert_alignment=0), ValueError, "expert_alignment"),
    (dict(num_worst_tokens=-1), ValueError, "num_worst_tokens"),
    (dict(config=(24, 6, 256)), TypeError, "Config"),
    (dict(num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32)), ValueError, "NVLink"),
    (dict(allocate_on_comm_stream=True, async_finish=True), ValueError, "previous_event"),
])
def test_dispatch_rejects(buf, change, error, match):
    kwargs = dict(x=bf16(T, H), **layout_args())
    kwargs.update(change)
    with pytest.raises(error, match=match):
        buf.dispatch(**kwargs)


def test_cached_dispatch_checks(buf):
    with launched:
        buf.dispatch(bf16(T, H), handle=handle())
    with launched:
        buf.dispatch((torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 2)), handle=handle())
    with launched:
        buf.dispatch((torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(2, T).T), handle=handle())
    with pytest.raises(ValueError, match="zero stride"):
        buf.dispatch((torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 1).expand(T, 2)), handle=handle())
    with pytest.raises(TypeError, match="6-tuple"):
        buf.dispatch(bf16(T, H), handle=handle()[:5])
    bad = list(handle())
    bad[3] = bad[3].long()
    with pytest.raises(TypeError, match="recv_src_idx"):
        buf.dispatch(bf16(T, H), handle=tuple(bad))
    with pytest.raises(ValueError, match="tokens"):
        buf.dispatch(bf16(T + 1, H), handle=handle())
    with pytest.raises(ValueError, match="num_sms"):
        buf.dispatch(bf16(T, H), handle=handle(channels=12), config=epx.Config(8, 6, 256))


# ---- combine -----------------------------------------------------------------------------------------------------
def test_combine_checks(buf):
    h = handle(num_recv=7)
    with launched:
        buf.combine(bf16(7, H), h, topk_weights=torch.zeros(7, K), bias=(bf16(T, H), bf16(T, H)))
    with launched:
        buf.combine(bf16(7, H), h, bias=bf16(T, H), config=epx.Config(24, 6, 256))
    with pytest.raises(ValueError, match="shape"):
        buf.combine(bf16(8, H), h)
    with pytest.raises(TypeError, match="dtype"):
        buf.combine(torch.zeros(7, H), h)
    with pytest.raises(ValueError, match="topk_weights"):
        buf.combine(bf16(7, H), h, topk_weights=torch.zeros(6, K))
    with pytest.raises(ValueError, match="bias"):
        buf.combine(bf16(7, H), h, bias=bf16(T + 1, H))
    with pytest.raises(TypeError, match="bias"):
        buf.combine(bf16(7, H), h, bias=(bf16(T, H),) * 3)
    with pytest.raises(ValueError, match="num_sms"):
        buf.combine(bf16(7, H), h, config=epx.Config(8, 6, 256))
    with pytest.raises(ValueError, match="hidden % 8"):
        buf.combine(bf16(7, 12), h)
    # reduction: inside one NVLink domain only the flat order
    for reduction in (None, "flat"):
        with launched:
            buf.combine(bf16(7, H), h, reduction=reduction)
    with pytest.raises(ValueError, match="internode mode's order"):
        buf.combine(bf16(7, H), h, reduction="two_level")
    with pytest.raises(ValueError, match="reduction"):
        buf.combine(bf16(7, H), h, reduction="Flat")
    with pytest.raises(TypeError, match="reduction"):
        buf.combine(bf16(7, H), h, reduction=1)
    with pytest.raises(TypeError):
        buf.combine(bf16(7, H), h, None, None, None, None, False, False, "flat")  # keyword-only


# ---- internode --------------------------------------------------------------------------------------------------
G = 2
D = R // G


def internode_handle(num_recv=7, num_rdma_recv=5, channels=12, tokens=T):
    i32 = torch.int32
    return (torch.zeros(tokens, R, dtype=torch.bool), torch.zeros(D, channels, dtype=i32),
            torch.zeros(R, channels, dtype=i32), torch.zeros(D, channels, dtype=i32), torch.zeros(D, dtype=i32),
            torch.zeros(R, channels, dtype=i32), torch.zeros(R, dtype=i32), torch.zeros(num_recv, 8, dtype=torch.uint8),
            torch.zeros(tokens, D, dtype=i32), torch.zeros(num_rdma_recv, G, dtype=i32))


def test_internode_checks():
    buf = epx.Buffer._unlaunched(R, num_nvl_ranks=G, internode=True, low_latency_mode=False)
    with launched:
        buf.get_dispatch_layout(torch.zeros(T, K, dtype=torch.int64), E)
    with launched:
        buf.dispatch(bf16(T, H), **layout_args(), num_tokens_per_rdma_rank=torch.zeros(D, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(bf16(T, H), **layout_args(), num_tokens_per_rdma_rank=torch.zeros(R, dtype=torch.int32))
    h = internode_handle()
    with launched:
        buf.dispatch(bf16(T, H), handle=h)
    for reduction in (None, "two_level", "flat"):
        with launched:
            buf.combine(bf16(7, H), h, topk_weights=torch.zeros(7, K), bias=bf16(T, H), reduction=reduction)
    with pytest.raises(ValueError, match="shape"):
        buf.combine(bf16(5, H), h)  # rows of recv_x are recv_src_meta's, not send_nvl_head's
    with pytest.raises(TypeError, match="10-tuple"):
        buf.dispatch(bf16(T, H), handle=handle())
    with pytest.raises(ValueError, match="tokens"):
        buf.dispatch(bf16(T + 1, H), handle=h)
    with pytest.raises(ValueError, match="num_sms"):
        buf.combine(bf16(7, H), h, config=epx.Config(8, 6, 256))
    with pytest.raises(ValueError, match=r"handle\[9\] \(send_nvl_head\)"):
        buf.dispatch(bf16(T, H), handle=h[:9] + (torch.zeros(5, G + 1, dtype=torch.int32),))


# ---- low latency -------------------------------------------------------------------------------------------------
M = 16


def ll_handle(tokens=T, topk=K, hidden=H, experts=E, weights=False):
    native = _lib.LLHandle(0, tokens, hidden, topk, experts, M, None, None)
    if weights:  # a dispatch given topk_weights: its recv_topk_slots
        native.topk_slots = torch.zeros(R, M, topk, 2, dtype=torch.int32)
    L = experts // R
    return (torch.zeros(L, R * M, dtype=torch.int32), torch.zeros(L, R, dtype=torch.int64), M, hidden, experts, native)


def test_low_latency_dispatch_checks(buf):
    x, idx = bf16(T, H), torch.zeros(T, K, dtype=torch.int64)
    with launched:
        buf.low_latency_dispatch(x, idx, M, E)
    with launched:
        buf.low_latency_dispatch(bf16(T, 512), idx, M, E, use_fp8=True, round_scale=True, use_ue8m0=True,
                                 cumulative_local_expert_recv_stats=torch.zeros(E // R, dtype=torch.int32),
                                 return_recv_hook=True)
    with pytest.raises(ValueError, match="more than"):
        buf.low_latency_dispatch(bf16(M + 1, H), torch.zeros(M + 1, K, dtype=torch.int64), M, E)
    with pytest.raises(ValueError, match="hidden % 128"):
        buf.low_latency_dispatch(bf16(T, 64), idx, M, E)
    with launched:
        buf.low_latency_dispatch(bf16(T, 64), idx, M, E, use_fp8=False)
    with pytest.raises(ValueError, match="round_scale"):
        buf.low_latency_dispatch(bf16(T, 512), idx, M, E, use_ue8m0=True)
    with pytest.raises(ValueError, match="512"):
        buf.low_latency_dispatch(x, idx, M, E, round_scale=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="multiple"):
        buf.low_latency_dispatch(x, idx, M, E + 2)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, idx, 5000, E)
    with pytest.raises(TypeError, match="topk_idx"):
        buf.low_latency_dispatch(x, idx.int(), M, E)
    with pytest.raises(ValueError, match="cumulative"):
        buf.low_latency_dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32))
    with pytest.raises(ValueError, match="both"):
        buf.low_latency_dispatch(x, idx, M, E, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="16-byte"):
        buf.low_latency_dispatch(misaligned_bf16(T, H), idx, M, E)
    # topk_weights (keyword-only): carried for the rank-reduced combine
    with launched:
        buf.low_latency_dispatch(x, idx, M, E, topk_weights=torch.zeros(T, K))
    with launched:
        buf.low_latency_dispatch(x, idx, M, E, topk_weights=torch.zeros(T, K), return_recv_hook=True)
    with pytest.raises(TypeError, match="topk_weights"):
        buf.low_latency_dispatch(x, idx, M, E, topk_weights=torch.zeros(T, K, dtype=torch.float64))
    with pytest.raises(ValueError, match="topk_weights"):
        buf.low_latency_dispatch(x, idx, M, E, topk_weights=torch.zeros(T, K + 1))


def test_low_latency_combine_checks(buf):
    L = E // R
    y, idx, w = bf16(L, R * M, H), torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)
    with launched:
        buf.low_latency_combine(y, idx, w, ll_handle(), out=bf16(T, H), zero_copy=True)
    with launched:
        buf.low_latency_combine(y, idx, w, ll_handle(), use_logfmt=True, zero_copy=True, return_recv_hook=True)
    with launched:
        buf.low_latency_combine(y, idx, w, ll_handle(), use_logfmt=1)
    with pytest.raises(ValueError, match="hidden % 128"):
        buf.low_latency_combine(bf16(L, R * M, 64), idx, w, ll_handle(hidden=64), use_logfmt=True)
    with launched:
        buf.low_latency_combine(bf16(L, R * M, 64), idx, w, ll_handle(hidden=64), use_logfmt=False)
    with pytest.raises(TypeError, match="use_logfmt"):
        buf.low_latency_combine(y, idx, w, ll_handle(), use_logfmt="yes")
    with pytest.raises(TypeError, match="handle"):
        buf.low_latency_combine(y, idx, w, ll_handle()[:5])
    with pytest.raises(ValueError, match="shape"):
        buf.low_latency_combine(bf16(L, R * M, H + 8), idx, w, ll_handle())
    with pytest.raises(ValueError, match="topk_idx"):
        buf.low_latency_combine(y, torch.zeros(T + 1, K, dtype=torch.int64), w, ll_handle())
    with pytest.raises(TypeError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w.double(), ll_handle())
    with pytest.raises(TypeError, match="out"):
        buf.low_latency_combine(y, idx, w, ll_handle(), out=torch.zeros(T, H))
    with pytest.raises(ValueError, match="both"):
        buf.low_latency_combine(y, idx, w, ll_handle(), async_finish=True, return_recv_hook=True)
    # reduction (keyword-only): "flat" (the default) or "rank" (needs a dispatch with topk_weights)
    with launched:
        buf.low_latency_combine(y, idx, w, ll_handle(), reduction="flat")
    with launched:
        buf.low_latency_combine(y, idx, w, ll_handle(weights=True), reduction="rank", return_recv_hook=True)
    with pytest.raises(ValueError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w, ll_handle(), reduction="rank")
    with pytest.raises(ValueError, match="use_logfmt"):
        buf.low_latency_combine(y, idx, w, ll_handle(weights=True), reduction="rank", use_logfmt=True)
    with pytest.raises(ValueError, match="reduction"):
        buf.low_latency_combine(y, idx, w, ll_handle(weights=True), reduction="two_level")
    with pytest.raises(TypeError, match="reduction"):
        buf.low_latency_combine(y, idx, w, ll_handle(weights=True), reduction=3)
    with pytest.raises(TypeError, match="handle"):
        buf.get_next_low_latency_combine_buffer((1, 2, 3))


def test_clean_low_latency_buffer_checks(buf):
    with launched:
        buf.clean_low_latency_buffer(M, H, E)
    with pytest.raises(ValueError, match="multiple"):
        buf.clean_low_latency_buffer(M, H, E + 1)
    small = epx.Buffer._unlaunched(R, num_rdma_bytes=1024)
    with pytest.raises(epx.BufferTooSmallError, match="get_low_latency_rdma_size_hint"):
        small.clean_low_latency_buffer(M, H, E)


def test_destroyed_buffer_says_so(buf):
    buf.destroy()  # nothing to free: a no-op
    with pytest.raises(epx.FailedStateError, match="destroyed"):
        buf.set_timeout(1.0)
    assert ctypes.sizeof(_lib.LLHandle) > 0


# ---- the same checks after a call that passed them ----------------------------------------------------------------
# Cached dispatch, combine and the low-latency calls remember the last arguments whose checks passed and take a
# short path when a call repeats them. Each bad call below must fail the same way on a fresh Buffer and on one
# whose last two calls (the second on the short path) were good; a good variant must get through on both.
def outcome(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return type(e), str(e)
    return None, None


def same_after_good_calls(good, call, expect):
    cold = outcome(lambda: call(epx.Buffer._unlaunched(R)))
    assert cold[0] is expect, cold
    warm = epx.Buffer._unlaunched(R)
    for _ in range(2):
        with launched:
            good(warm)
    assert outcome(lambda: call(warm)) == cold


def misaligned(*shape, dtype=torch.bfloat16):
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


FAILED = epx.FailedStateError
LL_X, LL_IDX = bf16(T, H), torch.zeros(T, K, dtype=torch.int64)
LL_STATS = torch.zeros(E // R, dtype=torch.int32)
LL_DISPATCH_CASES = [
    (lambda b: b.low_latency_dispatch(LL_X.float(), LL_IDX, M, E), TypeError),
    (lambda b: b.low_latency_dispatch(misaligned(T, H), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch(bf16(H, T).t(), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X.to("meta"), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch(bf16(T * H), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch(bf16(1, T, H), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch([[0]], LL_IDX, M, E), TypeError),
    (lambda b: b.low_latency_dispatch(bf16(T, 384), LL_IDX, M, E), FAILED),
    (lambda b: b.low_latency_dispatch(bf16(T, 64), LL_IDX, M, E), ValueError),
    (lambda b: b.low_latency_dispatch(bf16(M + 1, H), torch.zeros(M + 1, K, dtype=torch.int64), M, E), ValueError),
    (lambda b: b.low_latency_dispatch(bf16(0, H), torch.zeros(0, K, dtype=torch.int64), M, E), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX.int(), M, E), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, torch.zeros(T + 1, K, dtype=torch.int64), M, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, torch.zeros(T, K + 1, dtype=torch.int64), M, E), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, torch.zeros(T, 33, dtype=torch.int64), M, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, torch.zeros(K, T, dtype=torch.int64).t(), M, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX.to("meta"), M, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, [[0]], M, E), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, float(M), E), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, True, E), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, torch.tensor(M), E), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, 5000, E), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M + 1, E), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E + 2), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, float(E)), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_fp8=1), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_fp8="yes"), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_fp8=None), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_fp8=torch.tensor(True)), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, round_scale=1.0), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_ue8m0=True), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, cumulative_local_expert_recv_stats=LL_STATS), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, cumulative_local_expert_recv_stats=LL_STATS.repeat(2)),
     ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, cumulative_local_expert_recv_stats=LL_STATS.float()),
     TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, topk_weights=torch.zeros(T, K)), FAILED),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, topk_weights=torch.zeros(T, K + 1)), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, topk_weights=torch.zeros(T, K).double()), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, async_finish=True, return_recv_hook=True), ValueError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, async_finish="yes"), TypeError),
    (lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, return_recv_hook=True), FAILED),
]


@pytest.mark.parametrize("use_fp8", [True, False])
@pytest.mark.parametrize("case", range(len(LL_DISPATCH_CASES)))
def test_low_latency_dispatch_checks_after_good_calls(case, use_fp8):
    call, expect = LL_DISPATCH_CASES[case]
    same_after_good_calls(lambda b: b.low_latency_dispatch(LL_X, LL_IDX, M, E, use_fp8=use_fp8), call, expect)


LL_Y, LL_W = bf16(E // R, R * M, H), torch.zeros(T, K)
LL_HANDLE = ll_handle()
LL_COMBINE_CASES = [
    (lambda b: b.low_latency_combine(LL_Y.float(), LL_IDX, LL_W, LL_HANDLE), TypeError),
    (lambda b: b.low_latency_combine(misaligned(E // R, R * M, H), LL_IDX, LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(bf16(E // R, R * M, H + 8), LL_IDX, LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(bf16(R * M, E // R, H).transpose(0, 1), LL_IDX, LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y.to("meta"), LL_IDX, LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(None, LL_IDX, LL_W, LL_HANDLE), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, torch.zeros(T + 1, K, dtype=torch.int64), LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX.int(), LL_W, LL_HANDLE), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, torch.zeros(K, T, dtype=torch.int64).t(), LL_W, LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W.double(), LL_HANDLE), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, torch.zeros(T, K + 1), LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, torch.zeros(K, T).t(), LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W.to("meta"), LL_HANDLE), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, out=bf16(T, H)), FAILED),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, out=torch.zeros(T, H)), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, out=bf16(T + 1, H)), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, out=misaligned(T, H)), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, zero_copy=1), FAILED),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, zero_copy="yes"), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, use_logfmt=True), FAILED),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, use_logfmt="yes"), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, reduction="flat"), FAILED),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, reduction="rank"), ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, reduction=3), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, async_finish=True, return_recv_hook=True),
     ValueError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE, return_recv_hook=True), FAILED),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE[:5]), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE[:5] + ("native",)), TypeError),
    (lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, ll_handle()), FAILED),
    (lambda b: b.low_latency_combine(bf16(E // R, R * M, 384), LL_IDX, LL_W, ll_handle(hidden=384)), FAILED),
]


@pytest.mark.parametrize("case", range(len(LL_COMBINE_CASES)))
def test_low_latency_combine_checks_after_good_calls(case):
    call, expect = LL_COMBINE_CASES[case]
    same_after_good_calls(lambda b: b.low_latency_combine(LL_Y, LL_IDX, LL_W, LL_HANDLE), call, expect)


def test_low_latency_combine_reads_the_native_handle_every_call():
    """The token count of a handle is the native handle's, read on every call (the short path does not keep it)."""
    mine = ll_handle()
    warm = epx.Buffer._unlaunched(R)
    for _ in range(2):
        with launched:
            warm.low_latency_combine(LL_Y, LL_IDX, LL_W, mine)
    mine[5].num_tokens = T + 1
    with pytest.raises(ValueError, match="topk_idx"):
        warm.low_latency_combine(LL_Y, LL_IDX, LL_W, mine)


HT_X, HT_HANDLE, HT_W = bf16(T, H), handle(num_recv=7), torch.zeros(7, K)
FP8_X = (torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, 2))
CACHED_DISPATCH_CASES = [
    (lambda b: b.dispatch(HT_X.float(), handle=HT_HANDLE), TypeError),
    (lambda b: b.dispatch(misaligned(T, H), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(bf16(T + 1, H), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(bf16(T, 12), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(bf16(H, T).t(), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(HT_X.to("meta"), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(bf16(T * H), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(bf16(T, 2 * H), handle=HT_HANDLE), FAILED),
    (lambda b: b.dispatch(FP8_X, handle=HT_HANDLE), FAILED),
    (lambda b: b.dispatch((FP8_X[0], torch.zeros(1, 2).expand(T, 2)), handle=HT_HANDLE), ValueError),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, config=epx.Config(8, 6, 256)), ValueError),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, config=epx.Config(24, 6, 256)), FAILED),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, async_finish="yes"), TypeError),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, async_finish=True), FAILED),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, previous_event="now"), TypeError),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE, allocate_on_comm_stream=True), ValueError),
    (lambda b: b.dispatch(HT_X, handle=HT_HANDLE[:5]), TypeError),
    (lambda b: b.dispatch(HT_X, handle=handle(num_recv=7)), FAILED),
]


@pytest.mark.parametrize("case", range(len(CACHED_DISPATCH_CASES)))
def test_cached_dispatch_checks_after_good_calls(case):
    call, expect = CACHED_DISPATCH_CASES[case]
    same_after_good_calls(lambda b: b.dispatch(HT_X, handle=HT_HANDLE), call, expect)


COMBINE_CASES = [
    (lambda b: b.combine(bf16(8, H), HT_HANDLE, topk_weights=HT_W), ValueError),
    (lambda b: b.combine(torch.zeros(7, H), HT_HANDLE, topk_weights=HT_W), TypeError),
    (lambda b: b.combine(bf16(7, 12), HT_HANDLE, topk_weights=HT_W), ValueError),
    (lambda b: b.combine(misaligned(7, H), HT_HANDLE, topk_weights=HT_W), ValueError),
    (lambda b: b.combine(bf16(H, 7).t(), HT_HANDLE, topk_weights=HT_W), ValueError),
    (lambda b: b.combine(bf16(7, H).to("meta"), HT_HANDLE, topk_weights=HT_W), ValueError),
    (lambda b: b.combine(bf16(7, 2 * H), HT_HANDLE, topk_weights=HT_W), FAILED),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE), FAILED),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=torch.zeros(6, K)), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W.double()), TypeError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=torch.zeros(7, 33)), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=torch.zeros(7, 0)), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=torch.zeros(K, 7).t()), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W.to("meta")), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, bias=bf16(T + 1, H)), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, bias=bf16(T, H)), FAILED),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, config=epx.Config(8, 6, 256)), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, reduction="two_level"), ValueError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, reduction=1), TypeError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, reduction="flat"), FAILED),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, async_finish="yes"), TypeError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, async_finish=1), FAILED),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=HT_W, previous_event="now"), TypeError),
    (lambda b: b.combine(bf16(7, H), HT_HANDLE[:5], topk_weights=HT_W), TypeError),
    (lambda b: b.combine(bf16(7, H), handle(num_recv=7), topk_weights=HT_W), FAILED),
]


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("case", range(len(COMBINE_CASES)))
def test_combine_checks_after_good_calls(case, weights):
    call, expect = COMBINE_CASES[case]
    good_w = HT_W if weights else None
    same_after_good_calls(lambda b: b.combine(bf16(7, H), HT_HANDLE, topk_weights=good_w), call, expect)
