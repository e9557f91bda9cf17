"""The stream choreography of every epx.Buffer operation, on a CPU (fake streams and events, a stub library; see
_fake_cuda.py): which stream each launch is enqueued on and what it is ordered after, for deep_ep's
async_finish / previous_event / allocate_on_comm_stream and the low-latency hook. These are the semantics the
host-overhead work must keep; the GPU suites check the data.

Orderings are checked with vector clocks: a marker op put on the compute stream before the call must (or must
not) precede the launch, and a marker put after the call must (or must not) follow it.
"""

import pytest

torch = pytest.importorskip("torch")
from _fake_cuda import FakeCuda, after, fake_buffer, struct_of, stub_library  # noqa: E402

R, E, T, H, K, M = 2, 8, 6, 128, 2, 8
LAUNCHES = {"epx_get_dispatch_layout", "epx_notify_dispatch", "epx_dispatch_sized", "epx_dispatch",
            "epx_dispatch_cached", "epx_combine", "epx_ll_dispatch", "epx_ll_combine"}


@pytest.fixture
def env():
    """-> (FakeCuda, a function making a Buffer). Launches are enqueued on the fake stream they were given."""
    try:
        with FakeCuda() as cuda:
            def wrap(name, fn):
                if name not in LAUNCHES:
                    return fn

                def launch(*args):
                    cuda.streams[int(args[-1])].enqueue(name)
                    return fn(*args)
                return launch

            with stub_library(wrap):
                yield cuda, lambda: fake_buffer(cuda, R)
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))


def launches_of(cuda, fn):
    """Runs fn between two compute markers; -> (before, result, launches in host order, after)."""
    before = cuda.compute.enqueue("before")
    counts = {id(s): len(s.ops) for s in cuda.streams.values()}
    result = fn()
    ops = sorted((op for s in cuda.streams.values() for op in s.ops[counts[id(s)]:] if op.name.startswith("epx_")),
                 key=lambda op: op.seq)
    end = cuda.compute.enqueue("after")
    assert ops, "nothing was launched"
    return before, result, ops, end


def inputs():
    x = torch.ones(T, H, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, dtype=torch.int64)
    w = torch.ones(T, K)
    return x, idx, w


def layout(buf):
    x, idx, w = inputs()
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                topk_weights=w)


def dispatched(buf):
    x, _, _ = inputs()
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout(buf))
    return x, recv_x, recv_w, handle


# Each high-throughput operation as fn(buf, **stream_kwargs) -> (event, output tensors), after its set-up.
def op_layout(buf):
    _, idx, _ = inputs()

    def run(**kw):
        ntr, _, nte, itr, event = buf.get_dispatch_layout(idx, E, **kw)
        return event, (ntr, nte, itr)
    return run


def op_dispatch(buf):
    x, _, _ = inputs()
    args = layout(buf)

    def run(**kw):
        recv_x, recv_idx, recv_w, _, handle, event = buf.dispatch(x, **args, **kw)
        return event, (recv_x, recv_idx, recv_w) + handle[:4] + handle[5:]
    return run


def op_cached_dispatch(buf):
    x, _, _, handle = dispatched(buf)

    def run(**kw):
        recv_x, _, _, _, _, event = buf.dispatch(x, handle=handle, **kw)
        return event, (recv_x,)
    return run


def op_combine(buf):
    _, recv_x, recv_w, handle = dispatched(buf)

    def run(**kw):
        combined, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w, **kw)
        return event, (combined, combined_w)
    return run


HT_OPS = [op_layout, op_dispatch, op_cached_dispatch, op_combine]


@pytest.mark.parametrize("make", HT_OPS, ids=lambda f: f.__name__[3:])
def test_sync_runs_on_comm_stream_between_compute_work(env, make):
    cuda, new_buffer = env
    buf = new_buffer()
    run = make(buf)
    before, (event, _), ops, end = launches_of(cuda, run)
    comm = buf.get_comm_stream()
    for op in ops:
        # Layout, cached dispatch and combine may run straight on the current stream once comm is settled (the
        # set-up, or the first of the two calls, ended with a synchronous call); the ordering is what counts.
        direct_ok = make in (op_layout, op_cached_dispatch, op_combine) and op.stream is cuda.compute
        assert op.stream is comm or direct_ok, op.name
        assert after(op, before), f"{op.name} does not wait for earlier work on the current stream"
        assert after(end, op), f"later work on the current stream does not wait for {op.name}"
    assert event.event is None
    assert not cuda.record_stream_calls
    # twice: a second call (cached state) orders the same way
    before, (event, _), ops, end = launches_of(cuda, run)
    assert all(after(op, before) and after(end, op) for op in ops)


@pytest.mark.parametrize("make", [op_cached_dispatch, op_combine], ids=lambda f: f.__name__[3:])
def test_settled_sync_cached_dispatch_and_combine_run_on_the_current_stream(env, make):
    """As the low-latency calls: once comm is settled, a synchronous cached dispatch or combine launches on the
    current stream with one current-stream lookup; a call from another current stream goes through comm and
    stays behind it; get_comm_stream turns the shortcut off."""
    cuda, new_buffer = env
    buf = new_buffer()
    run = make(buf)  # its set-up ends with a synchronous dispatch: comm is settled on compute
    calls = cuda.calls
    before, _, ops, end = launches_of(cuda, run)
    assert [op.stream for op in ops] == [cuda.compute] and after(ops[0], before) and after(end, ops[0])
    assert cuda.calls - calls == 1, "one current-stream lookup, no event record or wait"
    comm = buf._streams.comm
    other = cuda.new_stream("other")
    with torch.cuda.stream(other):
        n = len(comm.ops)
        run()
        moved = [op for op in comm.ops[n:] if op.name.startswith("epx_")]
    assert len(moved) == 1 and after(moved[0], ops[0]), "another current stream: through comm, behind the last call"
    buf.get_comm_stream()
    _, _, ops, end = launches_of(cuda, run)
    assert [op.stream for op in ops] == [comm] and after(end, ops[0])


def test_settled_sync_layout_runs_on_the_current_stream(env):
    """get_dispatch_layout takes the same shortcut: its first call goes through comm, the next (comm settled on the
    current stream) launches there with one current-stream lookup, ordered between the compute work around it."""
    cuda, new_buffer = env
    buf = new_buffer()
    run = op_layout(buf)
    _, _, ops, _ = launches_of(cuda, run)
    assert [op.stream for op in ops] == [buf._streams.comm]
    calls = cuda.calls
    before, (event, _), ops, end = launches_of(cuda, run)
    assert [op.stream for op in ops] == [cuda.compute] and after(ops[0], before) and after(end, ops[0])
    assert cuda.calls - calls == 1, "one current-stream lookup, no event record or wait"
    assert event.event is None


@pytest.mark.parametrize("make", HT_OPS, ids=lambda f: f.__name__[3:])
def test_async_returns_an_event_and_leaves_the_current_stream_free(env, make):
    cuda, new_buffer = env
    buf = new_buffer()
    run = make(buf)
    before, (event, outputs), ops, end = launches_of(cuda, lambda: run(async_finish=True))
    comm = buf.get_comm_stream()
    for op in ops:
        assert op.stream is comm and after(op, before)
        assert not after(end, op), "async_finish must not make the current stream wait"
    assert event.event is not None
    event.current_stream_wait()
    waited = cuda.compute.enqueue("waited")
    assert all(after(waited, op) for op in ops)
    recorded = {(id(t), s.name) for t, s in cuda.record_stream_calls}
    for t in outputs:
        if t is not None:
            assert (id(t), "comm") in recorded, "an output was not recorded on the communication stream"
    # each async call gets its own event (the caller may hold several)
    cuda.record_stream_calls.clear()
    _, (event2, _), _, _ = launches_of(cuda, lambda: run(async_finish=True))
    assert event2.event is not event.event


@pytest.mark.parametrize("make", HT_OPS, ids=lambda f: f.__name__[3:])
@pytest.mark.parametrize("on_comm", [False, True], ids=["", "alloc_on_comm"])
def test_previous_event_replaces_the_wait_for_the_current_stream(env, make, on_comm):
    cuda, new_buffer = env
    buf = new_buffer()
    run = make(buf)
    side = cuda.new_stream("side")
    side_op = side.enqueue("side work")
    prev = cuda.Event()
    prev.record(side)
    cuda.stream_contexts.clear()
    before, (event, outputs), ops, end = launches_of(
        cuda, lambda: run(previous_event=prev, async_finish=True, allocate_on_comm_stream=on_comm))
    for op in ops:
        assert op.stream is buf.get_comm_stream()
        assert after(op, side_op), "the launch does not wait for previous_event"
        assert not after(op, before), "with previous_event the launch must not wait for the current stream"
        assert not after(end, op)
    assert (buf.get_comm_stream() in cuda.stream_contexts) == on_comm, "outputs allocated on the wrong stream"
    if on_comm:
        recorded = {(id(t), s.name) for t, s in cuda.record_stream_calls}
        for t in outputs:
            if t is not None:
                assert (id(t), "compute") in recorded, "an output owned by the comm stream was not recorded on compute"
    # an EventOverlap is accepted as previous_event too
    side_op2 = side.enqueue("side work 2")
    ev = cuda.Event()
    ev.record(side)
    from epx import EventOverlap
    _, _, ops, _ = launches_of(cuda, lambda: run(previous_event=EventOverlap(ev), async_finish=True))
    assert all(after(op, side_op2) for op in ops)


def test_sync_call_with_previous_event_makes_the_current_stream_wait(env):
    cuda, new_buffer = env
    buf = new_buffer()
    run = op_combine(buf)
    side = cuda.new_stream("side")
    side_op = side.enqueue("side work")
    prev = cuda.Event()
    prev.record(side)
    before, (event, _), ops, end = launches_of(cuda, lambda: run(previous_event=prev))
    assert all(after(op, side_op) and not after(op, before) and after(end, op) for op in ops)
    assert event.event is None


def test_current_stream_is_followed_when_it_changes(env):
    """The current stream is looked up on every call (a cache of it must notice a torch.cuda.stream switch)."""
    cuda, new_buffer = env
    buf = new_buffer()
    run = op_cached_dispatch(buf)
    run()
    other = cuda.new_stream("other")
    with torch.cuda.stream(other):
        first = other.enqueue("before on other")
        counts = len(buf.get_comm_stream().ops)
        run()
        later = other.enqueue("after on other")
    ops = buf.get_comm_stream().ops[counts:]
    assert ops and all(after(op, first) and after(later, op) for op in ops)
    _, _, ops, end = launches_of(cuda, run)  # and back on the compute stream
    assert all(after(end, op) for op in ops)


# ---- low latency ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["dispatch", "combine"])
@pytest.mark.parametrize("mode", ["sync", "async", "hook"])
def test_low_latency_streams(env, which, mode):
    cuda, new_buffer = env
    buf = new_buffer()
    x, idx, w = inputs()
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    kw = {"async": dict(async_finish=True), "hook": dict(return_recv_hook=True), "sync": {}}[mode]
    if which == "dispatch":
        def call():
            out = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, **kw)
            return out[3], out[4], (out[0], out[1], out[2][0], out[2][1])
    else:
        buf.low_latency_combine(recv_x, idx, w, handle)  # keep the buffer sets paired

        def call():
            recv, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            out = buf.low_latency_combine(recv, idx, w, h, **kw)
            return out[1], out[2], (out[0],)
    before, (event, hook, outputs), ops, end = launches_of(cuda, call)
    op = ops[-1]
    if mode == "hook":
        assert op.stream is cuda.compute and after(op, before)
        n = len(cuda.compute.ops)
        hook()
        recv = [o for o in cuda.compute.ops[n:] if o.name.startswith("epx_")]
        assert len(recv) == 1 and after(recv[0], op)
        return
    assert after(op, before)
    if mode == "sync":  # on comm or, once comm is settled, on the current stream (Streams.direct)
        assert after(end, op) and event.event is None
        return
    assert op.stream is buf.get_comm_stream()
    assert not after(end, op), "async_finish must not make the current stream wait"
    assert event.event is not None
    assert all(any(t is k for k in event.extra_tensors) for t in outputs), "outputs not kept alive by the event"
    event.current_stream_wait()
    assert after(cuda.compute.enqueue("waited"), op)


def test_low_latency_sync_calls_run_on_the_current_stream_once_comm_is_settled(env):
    """A synchronous low-latency call goes through comm until the last operation there ended with the current
    stream waiting for it; from then on it launches on the current stream with no stream or event calls of its
    own. An async call, another current stream or handing comm out (get_comm_stream) brings comm back."""
    cuda, new_buffer = env
    buf = new_buffer()
    x, idx, w = inputs()
    comm = buf._streams.comm  # not get_comm_stream(): handing comm out turns the shortcut off

    def pair(**kw):
        recv, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, **kw)
        return buf.low_latency_combine(recv, idx, w, h, **kw)

    _, _, ops, end = launches_of(cuda, pair)  # nothing known about comm yet
    assert ops[0].stream is comm and all(after(end, op) for op in ops)
    calls = cuda.calls
    before, _, ops, end = launches_of(cuda, pair)  # settled: straight onto the current stream
    assert [op.stream for op in ops] == [cuda.compute, cuda.compute]
    assert all(after(op, before) and after(end, op) for op in ops)
    assert cuda.calls - calls == 2, "one current-stream lookup per call, no event record or wait"

    _, _, ops, _ = launches_of(cuda, lambda: pair(async_finish=True))
    assert all(op.stream is comm for op in ops)
    # Async work on comm: the next call goes through comm again (and its end settles comm for the one after).
    before, (_, event, _), ops, end = launches_of(cuda, pair)
    assert [op.stream for op in ops] == [comm, cuda.compute] and event.event is None
    assert all(after(op, before) and after(end, op) for op in ops) and after(ops[1], ops[0])

    direct_combine = [op for op in cuda.compute.ops if op.name == "epx_ll_combine"][-1]  # ran on compute
    other = cuda.new_stream("other")
    with torch.cuda.stream(other):
        first = other.enqueue("first on other")
        n = len(comm.ops)
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        ops = [op for op in comm.ops[n:] if op.name.startswith("epx_")]
        later = other.enqueue("after on other")
    assert len(ops) == 1 and after(ops[0], first) and after(later, ops[0]), "another current stream goes through comm"
    # ... and stays behind what ran straight on the old current stream: one order for the Buffer's operations.
    assert after(ops[0], direct_combine)
    recv, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)  # back on compute: comm first
    buf.low_latency_combine(recv, idx, w, h)

    pair()  # settled on compute again
    buf.get_comm_stream()
    _, _, ops, end = launches_of(cuda, pair)
    assert all(op.stream is comm and after(end, op) for op in ops), "after get_comm_stream every call uses comm"


def test_cpu_overhead_harness_runs():
    """overhead_cpu.py (the CPU timing of this layer) keeps working: a few calls of every row."""
    import overhead_cpu
    try:
        results = overhead_cpu.measure(calls=3, reps=1)
    except RuntimeError as e:  # no C compiler for the stub
        pytest.skip(str(e))
    assert set(results) >= {"dispatch (cached)", "combine", "low-latency dispatch", "low-latency combine"}
    assert all(r["python_us"] > 0 and r["ctypes_us"] > 0 for r in results.values())


def test_low_latency_hooks_keep_their_own_arguments(env):
    """Calls without a hook reuse one set of argument structs; a hook's receive phase runs later and must
    still see its own call's pointers, even after other calls (double buffering: dispatch i+1 is sent
    before combine i is received)."""
    cuda, new_buffer = env
    buf = new_buffer()
    from epx import _lib
    seen = []
    library = _lib.lib()
    for name in ("epx_ll_dispatch", "epx_ll_combine"):
        inner = getattr(library, name)

        def spy(*args, _inner=inner, _name=name):
            phases = args[3] if _name == "epx_ll_dispatch" else args[4]
            seen.append((_name, phases, struct_of(args[1]).x))
            return _inner(*args)
        setattr(library, name, spy)
    x1, idx, w = inputs()
    x2 = x1.clone()
    r1 = buf.low_latency_dispatch(x1, idx, M, E, use_fp8=False, return_recv_hook=True)
    r2 = buf.low_latency_dispatch(x2, idx, M, E, use_fp8=False, return_recv_hook=True)
    buf.low_latency_dispatch(x2, idx, M, E, use_fp8=False)  # a call without a hook in between
    y1, y2 = r1[0].clone(), r2[0].clone()
    c1 = buf.low_latency_combine(y1, idx, w, r1[2], return_recv_hook=True)
    buf.low_latency_combine(y2, idx, w, r2[2])
    seen.clear()
    r1[4]()
    r2[4]()
    c1[2]()
    assert seen == [("epx_ll_dispatch", 2, x1.data_ptr()), ("epx_ll_dispatch", 2, x2.data_ptr()),
                    ("epx_ll_combine", 2, y1.data_ptr())]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float-scales", "ue8m0"])
def test_low_latency_dispatch_output_shapes_and_strides(env, ue8m0):
    """deep_ep's layouts: e4m3 [L, R*M, H]; scales logical [L, R*M, groups] stored token-minor (strides
    (groups*R*M, 1, R*M)); count [L]; src info [L, R*M]; layout range [L, R] int64."""
    cuda, new_buffer = env
    buf = new_buffer()
    h = 512  # a multiple of 512 for UE8M0
    x = torch.ones(T, h, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, dtype=torch.int64)
    (q, scales), count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=ue8m0,
                                                                use_ue8m0=ue8m0)
    L, rows = E // R, R * M
    groups = h // 512 if ue8m0 else h // 128
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (L, rows, h) and q.is_contiguous()
    assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
    assert tuple(scales.shape) == (L, rows, groups) and scales.stride() == (groups * rows, 1, rows)
    assert scales.transpose(1, 2).is_contiguous()
    assert count.dtype == torch.int32 and tuple(count.shape) == (L,)
    assert handle[0].dtype == torch.int32 and tuple(handle[0].shape) == (L, rows)
    assert handle[1].dtype == torch.int64 and tuple(handle[1].shape) == (L, R)


def test_low_latency_shape_checks_still_reject_after_a_good_call(env):
    """The remembered shape must not let anything through that the checks would reject."""
    cuda, new_buffer = env
    buf = new_buffer()
    x, idx, _ = inputs()
    buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    with pytest.raises(TypeError):
        buf.low_latency_dispatch(x, idx, float(M), E, use_fp8=False)
    with pytest.raises(ValueError):
        buf.low_latency_dispatch(x, idx, M, E + 1, use_fp8=False)
    with pytest.raises(ValueError):
        buf.low_latency_dispatch(x, idx, 0, E, use_fp8=False)
    buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)  # and the good shape still passes


def test_sized_dispatch_guesses_from_earlier_rows_and_repeats_when_short(env):
    """The ring dispatch with a layout sizes its outputs by a guess once a call with the same token count has run
    (high_throughput.py, _sized_rows): one epx_dispatch_sized on the comm stream, outputs the first N rows of the
    guessed ones. A guess below the rows received (the stub receives every token once) makes the call repeat as
    epx_notify_dispatch + epx_dispatch, with outputs of exactly N rows; EPX_HT_SIZED_DISPATCH=0 keeps two steps."""
    cuda, new_buffer = env
    buf = new_buffer()
    n = 40
    x, idx, w = torch.ones(n, H, dtype=torch.bfloat16), torch.zeros(n, K, dtype=torch.int64), torch.ones(n, K)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                topk_weights=w)
    comm = buf.get_comm_stream()

    def dispatch_ops():
        _, out, ops, _ = launches_of(cuda, lambda: buf.dispatch(x, **args))
        assert all(op.stream is comm for op in ops)
        return [op.name for op in ops], out

    names, out = dispatch_ops()
    assert names == ["epx_notify_dispatch", "epx_dispatch"], names
    assert buf._recv_rows[n] == [n]
    names, out = dispatch_ops()
    assert names == ["epx_dispatch_sized"], names
    recv_x, recv_idx, recv_w, _, handle, _ = out
    guess = n + (n >> 4) + 8
    assert recv_x.shape == (n, H) and recv_x.untyped_storage().nbytes() == guess * H * 2
    assert recv_idx.shape == recv_w.shape == (n, K) and handle[3].shape == (n,)
    buf._recv_rows[n] = [20]  # a guess of 29 rows: short
    names, out = dispatch_ops()
    assert names == ["epx_dispatch_sized", "epx_notify_dispatch", "epx_dispatch"], names
    assert out[0].shape == (n, H) and out[0].untyped_storage().nbytes() == n * H * 2
    assert buf._recv_rows[n] == [20, n]
    buf._sized_dispatch = False
    names, _ = dispatch_ops()
    assert names == ["epx_notify_dispatch", "epx_dispatch"], names
