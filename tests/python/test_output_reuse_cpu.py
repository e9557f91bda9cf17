"""The reuse of low-latency output sets (epx/_output_pool.py), on a CPU (fake streams, a stub library; see
_fake_cuda.py): a loop that drops its previous outputs allocates nothing after the first calls, and a set is never
handed out again while anything can still reach its memory, after a tensor of it changed in place, on another
stream, during CUDA-graph capture, with the switch off, or after destroy; the library is asked to write the same
outputs as without reuse.

"Never handed out again while held" is checked on identity and memory: a held tensor stays alive, so no other
tensor can have its id() or its data pointer. A set that was dropped is gone, so what is checked there is what a
caller would see if it had come back (its metadata, its memory aliasing another tensor) and the pool's counts.
"""

import collections
import weakref

import pytest

torch = pytest.importorskip("torch")
from _fake_cuda import FakeCuda, fake_buffer, struct_of, stub_library  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

R, E, T, H, K, M = 2, 8, 6, 128, 2, 8
L, ROWS = E // R, R * M


@pytest.fixture
def env():
    """-> (FakeCuda, a function making a Buffer (reuse switched on unless reuse=None: the default), the launches
    seen: (name, phases, scalar arguments, output pointers) per C call of a low-latency dispatch or combine)."""
    launches = []
    try:
        with FakeCuda() as cuda:
            def wrap(name, fn):
                if name == "epx_ll_dispatch":
                    def spy(ptr, args, outs, phases, handle, stream):
                        a, o = struct_of(args), struct_of(outs)
                        launches.append((name, phases, (a.num_tokens, a.hidden, a.num_topk, a.num_experts,
                                                        a.num_max_dispatch_tokens_per_rank, a.use_fp8),
                                         (o.packed_recv_x, o.packed_recv_x_scales, o.packed_recv_count,
                                          o.recv_src_info, o.recv_layout_range, o.recv_topk_slots)))
                        return fn(ptr, args, outs, phases, handle, stream)
                    return spy
                if name == "epx_ll_combine":
                    def spy(ptr, args, handle, combined_x, phases, buffer_set, stream):
                        launches.append((name, phases, (), (combined_x,)))
                        return fn(ptr, args, handle, combined_x, phases, buffer_set, stream)
                    return spy
                return fn

            with stub_library(wrap):
                def new_buffer(reuse=True):
                    buf = fake_buffer(cuda, R)
                    if reuse is not None:
                        buf.set_low_latency_output_reuse(reuse)
                    return buf

                yield cuda, new_buffer, launches
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))


def inputs(tokens=T):
    x = torch.ones(tokens, H, dtype=torch.bfloat16)
    idx = torch.zeros(tokens, K, dtype=torch.int64)
    w = torch.ones(tokens, K)
    return x, idx, w


def step_inputs():
    """One dispatch + combine step's inputs: x, top-k ids and weights, and the expert outputs y the combine takes."""
    return (*inputs(), torch.zeros(L, ROWS, H, dtype=torch.bfloat16))


def dispatch(buf, fp8=False, **kw):
    x, idx, _ = inputs()
    return buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, **kw)


def tensors_of(result):
    """Every output tensor of a low_latency_dispatch result (recv_x or its (data, scales), count, handle's
    tensors, topk_slots), or of a combine result."""
    if len(result) == 3:  # combine
        return [result[0]]
    recv, count, handle = result[0], result[1], result[2]
    out = list(recv) if isinstance(recv, tuple) else [recv]
    out += [count, handle[0], handle[1]]
    slots = getattr(handle[5], "topk_slots", None)
    return out + ([slots] if slots is not None else [])


def footprint(ts):
    """What of a set must never show up in another call's outputs while it is held: ids and data pointers."""
    return {id(t) for t in ts}, {t.data_ptr() for t in ts}


def disjoint(result, held):
    ids, ptrs = held
    return all(id(t) not in ids and t.data_ptr() not in ptrs for t in tensors_of(result))


class CountAllocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("empty", "empty_strided", "new_empty", "new_empty_strided"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def counts(buf, kind="dispatch"):
    return buf.get_low_latency_output_reuse_counts()[kind]


def warm(buf, fp8=False):
    """Three dispatches and combines of the test's shapes, dropped, so that the next call of each kind reuses a set:
    a key's first call is not kept, its second is, and a third set is made while the second's handle is still
    referenced by the combine (which remembers the last handle it checked, until the next combine)."""
    x, idx, w, y = step_inputs()
    for _ in range(3):
        buf.low_latency_combine(y, idx, w, buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)[2])


def delta(buf, before, kind="dispatch"):
    """-> (sets reused, sets allocated) since counts were `before`."""
    now = counts(buf, kind)
    return now[0] - before[0], now[1] - before[1]


# ---- reuse happens -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("weights", [False, True], ids=["", "topk_weights"])
def test_a_decoding_loop_allocates_nothing_after_warm_up(env, fp8, weights):
    """As a decoding loop: the previous outputs stay in the loop's names until the next call's results replace
    them, so two sets alternate; after the first call (whose outputs a new key does not keep) and those two, no
    call allocates."""
    _, new_buffer, _ = env
    buf = new_buffer()
    x, idx, w, y = step_inputs()
    kw = dict(topk_weights=w) if weights else {}
    recv = count = handle = combined = None

    def step():
        nonlocal recv, count, handle, combined
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, **kw)
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)

    for _ in range(4):
        step()
    with CountAllocations() as mode:
        for _ in range(6):
            step()
    assert mode.count == 0, "steady-state calls allocated"
    assert counts(buf) == (7, 3, 2) and counts(buf, "combine") == (7, 3, 2)


def assert_allocates_every_call(buf, calls):
    """calls dispatches on buf allocate their 4 outputs each, and the Buffer keeps no set."""
    with CountAllocations() as mode:
        for _ in range(calls):
            dispatch(buf)
    assert mode.count == calls * 4 and counts(buf) == (0, 0, 0)


def assert_reuses_from_the_third_call(buf):
    for _ in range(3):
        dispatch(buf)
    assert counts(buf) == (1, 2, 1)  # the key's first call is not kept, its second is, the third reuses it


def test_reuse_is_off_by_default_and_can_be_switched(env):
    _, new_buffer, _ = env
    buf = new_buffer(reuse=None)
    assert buf.low_latency_output_reuse is False
    assert_allocates_every_call(buf, 3)
    buf.set_low_latency_output_reuse(True)
    assert buf.low_latency_output_reuse is True
    assert_reuses_from_the_third_call(buf)
    buf.set_low_latency_output_reuse(False)
    assert buf.low_latency_output_reuse is False and counts(buf) == (0, 0, 0)
    assert_allocates_every_call(buf, 2)
    buf.set_low_latency_output_reuse(True)
    assert_reuses_from_the_third_call(buf)


def test_the_environment_switch(env, monkeypatch):
    _, new_buffer, _ = env
    monkeypatch.setenv("EPX_LL_OUTPUT_REUSE", "0")
    buf = new_buffer(reuse=None)
    assert buf.low_latency_output_reuse is False
    assert_allocates_every_call(buf, 3)
    monkeypatch.setenv("EPX_LL_OUTPUT_REUSE", "1")
    assert new_buffer(reuse=None).low_latency_output_reuse is True
    monkeypatch.setenv("EPX_LL_OUTPUT_REUSE", "off")
    with pytest.raises(ValueError, match="EPX_LL_OUTPUT_REUSE must be 0 or 1"):
        new_buffer(reuse=None)


# ---- never while anything references the set -----------------------------------------------------------------
def _hold_tensor(result):
    return result[0]


def _hold_count(result):
    return result[1]


def _hold_scales(result):
    return result[0][1]


def _hold_handle(result):
    return result[2]


def _hold_src_info(result):
    return result[2][0]


def _hold_view(result):
    return result[0][1:3]


def _hold_inference_view(result):
    with torch.inference_mode():
        return result[0][1]


def _hold_storage(result):
    return result[0].untyped_storage()


def _hold_detached(result):
    return result[1].detach()


def _hold_weakref(result):
    return weakref.ref(result[0])


def _hold_dlpack(result):
    return torch.utils.dlpack.to_dlpack(result[2][1])


def _hold_list(result):
    return [result[1]]


HOLDERS = [_hold_tensor, _hold_count, _hold_scales, _hold_handle, _hold_src_info, _hold_view, _hold_inference_view,
           _hold_storage, _hold_detached, _hold_weakref, _hold_dlpack, _hold_list]


@pytest.mark.parametrize("hold", HOLDERS, ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("inference", [False, True], ids=["", "inference_mode"])
def test_a_set_is_not_handed_out_while_something_references_it(env, hold, inference):
    _, new_buffer, _ = env
    buf = new_buffer()
    context = torch.inference_mode() if inference else torch.no_grad()
    with context:
        fp8 = hold is _hold_scales
        warm(buf, fp8=fp8)
        before = counts(buf)
        result = dispatch(buf, fp8=fp8)  # a kept set handed out again: the pool's state after a reuse
        assert delta(buf, before) == (1, 0)
        held = footprint(tensors_of(result))
        holder = hold(result)
        del result
        for _ in range(4):
            assert disjoint(dispatch(buf, fp8=fp8), held), f"handed out while {hold.__name__[6:]} is held"
        # one new set (the other kept one holds the last combined handle), handed out again; the held one waits
        assert delta(buf, before) == (4, 1)
        del holder
        # Released: handed out again (the pool hands out its oldest free set first).
        again = dispatch(buf, fp8=fp8)
        assert delta(buf, before) == (5, 1) and any(id(t) in held[0] for t in tensors_of(again))


def test_an_owner_in_cpp_alone_holds_the_set(env, monkeypatch):
    """A DLPack capsule (like autograd or a collective's work object) owns the tensor from C++. Newer torch also
    counts that in the Python reference count; the tensor's own use count must catch it where torch does not (as
    if the Python count did not move)."""
    import epx._output_pool as output_pool
    python_refs = output_pool._refs
    monkeypatch.setattr(output_pool, "_refs", lambda o: 0 if isinstance(o, torch.Tensor) else python_refs(o))
    _, new_buffer, _ = env
    buf = new_buffer()
    warm(buf)
    result = dispatch(buf)
    held = footprint(tensors_of(result))
    capsule = _hold_dlpack(result)
    del result
    for _ in range(3):
        assert disjoint(dispatch(buf), held)
    del capsule
    assert any(id(t) in held[0] for t in tensors_of(dispatch(buf)))


@pytest.mark.parametrize("mode", ["async", "hook"])
@pytest.mark.parametrize("which", ["dispatch", "combine"])
def test_events_and_hooks_hold_their_sets(env, mode, which):
    """An EventOverlap of async_finish and a receive hook hold the call's tensors: the set is not handed out while
    either is alive, also when the caller dropped the outputs themselves."""
    _, new_buffer, _ = env
    buf = new_buffer()
    x, idx, w, y = step_inputs()
    kw = dict(async_finish=True) if mode == "async" else dict(return_recv_hook=True)

    def call(**extra):
        r = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, **(extra if which == "dispatch" else {}))
        if which == "combine":
            r = buf.low_latency_combine(y, idx, w, r[2], **extra)
        return r

    call()
    call()
    result = call(**kw)
    held = footprint(tensors_of(result))
    keeper = result[-2] if mode == "async" else result[-1]  # the event, or the hook
    del result
    for _ in range(3):
        assert disjoint(call(), held)
    if mode == "hook":
        keeper()  # the receive phase: the set stays held while the hook lives
        assert disjoint(call(), held)
    del keeper
    again = call()
    assert any(id(t) in held[0] for t in tensors_of(again)), "released by the event / hook: handed out again"


def test_combine_sets_follow_the_same_rules(env):
    _, new_buffer, _ = env
    buf = new_buffer()
    x, idx, w, y = step_inputs()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    buf.low_latency_combine(y, idx, w, handle)
    buf.low_latency_combine(y, idx, w, handle)
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    with torch.inference_mode():
        view = combined[1:]
    held = footprint([combined])
    del combined
    for _ in range(3):
        assert disjoint(buf.low_latency_combine(y, idx, w, handle), held)
    del view
    assert id(buf.low_latency_combine(y, idx, w, handle)[0]) in held[0]
    # out= bypasses the pool; another token count is another key
    out = torch.empty(T, H, dtype=torch.bfloat16)
    before = counts(buf, "combine")
    assert buf.low_latency_combine(y, idx, w, handle, out=out)[0] is out
    assert counts(buf, "combine") == before
    x4, idx4, w4 = inputs(4)
    _, _, handle4, _, _ = buf.low_latency_dispatch(x4, idx4, M, E, use_fp8=False)
    assert tuple(buf.low_latency_combine(y, idx4, w4, handle4)[0].shape) == (4, H)
    assert counts(buf, "combine")[2] == 0, "a new key drops the sets of the old one (and keeps its first call's)"
    buf.low_latency_combine(y, idx4, w4, handle4)
    assert counts(buf, "combine")[2] == 1


def test_a_key_that_changes_every_call_keeps_nothing(env):
    """The combine's key is its token count: a loop whose batch changes every step makes a set per call, as without
    reuse, and keeps none (no bookkeeping); a token count seen twice in a row is kept from its second call."""
    _, new_buffer, _ = env
    buf = new_buffer()
    y = torch.zeros(L, ROWS, H, dtype=torch.bfloat16)
    for tokens in (1, 2, 3, 4, 5, 6, 5, 4):
        x, idx, w = inputs(tokens)
        handle = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)[2]
        buf.low_latency_combine(y, idx, w, handle)
        assert counts(buf, "combine")[2] == 0
    assert counts(buf, "combine")[:2] == (0, 8)
    buf.low_latency_combine(y, idx, w, handle)
    assert counts(buf, "combine") == (0, 9, 1)


def test_the_pool_is_bounded(env):
    _, new_buffer, _ = env
    buf = new_buffer()
    held = [dispatch(buf) for _ in range(6)]
    assert counts(buf) == (0, 6, 3)
    del held


# ---- never after an in-place change of a tensor -----------------------------------------------------------------
def _resize(result, other):
    result[0].resize_(L - 1, ROWS, H)  # the same strides and data pointer: only the shape tells


def _resize_back(result, other):
    t = result[1]
    t.resize_(1000)
    t.resize_(L)


def _set_storage(result, other):
    result[2][0].set_(other.untyped_storage(), 0, (L, ROWS), (ROWS, 1))


def _as_strided(result, other):
    result[2][0].as_strided_((L, ROWS), (1, L))


def _squeeze(result, other):
    result[1].unsqueeze_(0)


def _transpose(result, other):
    result[2][1].t_()


def _data(result, other):
    result[2][0].data = other


def _data_dtype(result, other):
    result[0].data = result[0].view(torch.float16)


def _requires_grad(result, other):
    result[0].requires_grad_()


def _attribute(result, other):
    result[1].tag = "seen"


CHANGES = [_resize, _resize_back, _set_storage, _as_strided, _squeeze, _transpose, _data, _data_dtype,
           _requires_grad, _attribute]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__[1:])
def test_a_tensor_changed_in_place_is_never_handed_out_again(env, change):
    """Had the changed set come back, its tensor would show the change (another shape, strides, dtype, aliasing the
    caller's tensor, requiring grad, carrying an attribute) or the C call would get other pointers than the
    returned tensors'. The set goes (dropped; or, where its storage moved, kept as in use until evicted), and a new
    one takes its place."""
    _, new_buffer, launches = env
    buf = new_buffer()
    other = torch.zeros(L, ROWS, dtype=torch.int32)  # held by the caller throughout
    warm(buf)
    before = counts(buf)
    result = dispatch(buf)
    assert delta(buf, before) == (1, 0)
    change(result, other)
    del result
    fresh = dispatch(new_buffer())  # what the outputs look like
    for _ in range(4):
        result = dispatch(buf)
        for got, want in zip(tensors_of(result), tensors_of(fresh)):
            assert (got.shape, got.stride(), got.dtype, got.requires_grad) == \
                (want.shape, want.stride(), want.dtype, want.requires_grad)
            assert got.data_ptr() != other.data_ptr() and not hasattr(got, "tag")
        _, _, _, pointers = launches[-1]
        assert [t.data_ptr() for t in tensors_of(result)] == [p for p in pointers if p is not None]
        del result, got, want  # the loop's names hold the set too
    assert delta(buf, before) == (4, 1)  # the set that changed is not handed out again: one more allocated


# ---- never across streams, during capture, or after destroy ------------------------------------------------------
def test_no_reuse_on_another_stream(env):
    cuda, new_buffer, _ = env
    buf = new_buffer()
    warm(buf)
    before = counts(buf)
    dispatch(buf)
    assert delta(buf, before) == (1, 0)
    other = cuda.new_stream("other")
    with torch.cuda.stream(other):
        dispatch(buf)
        assert delta(buf, before) == (1, 1) and counts(buf)[2] == 0, "not reused on another stream, and dropped"
        dispatch(buf)
        dispatch(buf)
        assert delta(buf, before) == (2, 2) and counts(buf)[2] == 1  # reused on the new stream
    dispatch(buf)
    assert delta(buf, before) == (2, 3) and counts(buf)[2] == 0, \
        "back on the first stream: the other stream's set is dropped, not reused"


def test_no_reuse_and_nothing_kept_during_capture(env):
    cuda, new_buffer, _ = env
    buf = new_buffer()
    x, idx, w, y = step_inputs()
    warm(buf)
    r = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    c = buf.low_latency_combine(y, idx, w, r[2])
    eager = footprint(tensors_of(r) + tensors_of(c))  # alive in the pool: their ids and memory stay theirs
    del r, c
    before = counts(buf), counts(buf, "combine")
    queries = cuda.capture_queries
    cuda.capturing = True
    captured = []
    with CountAllocations() as mode:
        for _ in range(3):
            r = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            c = buf.low_latency_combine(y, idx, w, r[2])
            assert disjoint(r, eager) and disjoint(c, eager), "an eager set handed out during capture"
            captured += [weakref.ref(t) for t in tensors_of(r) + tensors_of(c)]
    assert mode.count == 3 * (4 + 1), "every call during capture allocates"
    del r, c
    cuda.capturing = False
    assert cuda.capture_queries - queries == 6
    assert (counts(buf), counts(buf, "combine")) == ((before[0][0], before[0][1] + 3, before[0][2]),
                                                      (before[1][0], before[1][1] + 3, before[1][2]))
    # After capture the eager sets are handed out again (and this combine replaces the captured handle that the
    # combine's short path remembered).
    with CountAllocations() as mode:
        r = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        c = buf.low_latency_combine(y, idx, w, r[2])
    assert mode.count == 0 and delta(buf, before[0]) == (1, 3) and delta(buf, before[1], "combine") == (1, 3)
    del r, c
    assert all(ref() is None for ref in captured), "a set allocated during capture was kept"


def test_destroy_drops_the_sets(env):
    _, new_buffer, _ = env
    buf = new_buffer()
    x, idx, w, y = step_inputs()
    warm(buf)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    alive = [weakref.ref(t) for t in (recv, handle[0], combined)]
    del recv, handle, combined
    assert all(r() is not None for r in alive), "kept by the pool"
    buf.destroy()
    assert all(r() is None for r in alive), "destroy() must drop the kept sets"
    assert counts(buf)[2] == 0 and counts(buf, "combine")[2] == 0


def test_inference_mode_and_deterministic_fill_are_respected(env):
    """Tensors made in inference mode are inference tensors: they are not handed out outside it, nor the others
    inside it. Deterministic algorithms fill new memory: no reuse then."""
    _, new_buffer, _ = env
    buf = new_buffer()
    for _ in range(2):
        assert not dispatch(buf)[0].is_inference()
        with torch.inference_mode():
            assert dispatch(buf)[0].is_inference()
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        before = counts(buf)
        with CountAllocations() as mode:
            for _ in range(3):
                dispatch(buf)
        assert mode.count == 3 * 4 and counts(buf)[0] == before[0]
    finally:
        torch.use_deterministic_algorithms(saved)


# ---- what the library is asked to write -------------------------------------------------------------------------
def _run(new_buffer, launches, reuse):
    """A fixed sequence of calls (a decoding loop with held outputs, a hook, FP8, topk_weights, an async call);
    -> per call: the C call's arguments, the returned tensors' layout, and each returned tensor's bytes after the
    "kernel" wrote a pattern of the call's number into exactly the memory it was given."""
    buf = new_buffer()
    buf.set_low_latency_output_reuse(reuse)
    x, idx, w, y = step_inputs()
    seen, held = [], collections.deque(maxlen=2)
    plan = [dict(), dict(), dict(), dict(), dict(use_fp8=True), dict(use_fp8=True), dict(use_fp8=True),
            dict(use_fp8=True), dict(), dict(topk_weights=w), dict(topk_weights=w), dict(topk_weights=w),
            dict(topk_weights=w), dict(), dict(), dict(return_recv_hook=True), dict(), dict(async_finish=True), dict(),
            dict(), dict(use_fp8=True), dict(use_fp8=True), dict(use_fp8=True)]
    for i, kw in enumerate(plan):
        kw = dict(kw)
        fp8 = kw.pop("use_fp8", False)
        n = len(launches)
        r = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, **kw)
        if kw.get("return_recv_hook"):
            r[4]()
        c = buf.low_latency_combine(y, idx, w, r[2])
        outs = tensors_of(r) + tensors_of(c)
        calls = [(name, phases, args) for name, phases, args, _ in launches[n:]]
        pointers = {p for _, _, _, ps in launches[n:] for p in ps if p is not None}
        assert pointers == {t.data_ptr() for t in outs}, "the library was given other memory than returned"
        out_bytes = []
        for t in outs:  # the kernel's writes: the whole memory of each tensor it was given
            raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            raw.fill_(i + 1)
            out_bytes.append(raw.clone())
        seen.append((calls, [(t.shape, t.stride(), t.dtype, t.requires_grad) for t in outs], out_bytes))
        if i % 3 == 0:
            held.append(r)  # some sets stay held for a few calls
    return seen, counts(buf)


def test_outputs_are_what_fresh_allocations_would_carry(env):
    _, new_buffer, launches = env
    fresh, fresh_counts = _run(new_buffer, launches, False)
    reused, reuse_counts = _run(new_buffer, launches, True)
    assert fresh_counts == (0, 0, 0) and reuse_counts[0] >= 5, "the reuse run must reuse"
    assert len(fresh) == len(reused)
    for i, ((calls_a, layout_a, bytes_a), (calls_b, layout_b, bytes_b)) in enumerate(zip(fresh, reused)):
        assert calls_a == calls_b, f"call {i}: the library got other arguments"
        assert layout_a == layout_b, f"call {i}: other output layouts"
        assert len(bytes_a) == len(bytes_b) and all(torch.equal(a, b) for a, b in zip(bytes_a, bytes_b))
