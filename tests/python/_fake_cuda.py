"""CUDA streams and events without a GPU, and libepx without kernels: what the CPU tests of the Python
layer's stream choreography and the CPU timing of its host overhead (overhead_cpu.py) run on.

- FakeCuda replaces torch's stream and event entry points (torch.cuda.current_stream, stream, Event,
  Tensor.record_stream, the raw ones epx._streams binds, and the capture query epx._output_pool binds) with
  objects that track ordering: every stream
  keeps a vector clock, an event records the clock of the stream it was recorded on, and waiting for an
  event merges that clock into the waiting stream's. `after(b, a)` then says whether operation b is ordered
  after operation a on the device.
- stub_library() builds tests/python/stub_epx.c (libepx's C ABI doing nothing) with the system C compiler
  and loads it as epx's library.

A Buffer to drive is made by fake_buffer(): Buffer._unlaunched on the CPU, given a native pointer and a
communication stream, so every method runs its Python code in full and calls the stub.
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import shutil
import subprocess
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


class Op:
    """One thing enqueued on a stream (a kernel launch, or a marker a test puts there)."""

    __slots__ = ("name", "stream", "clock", "seq")

    def __init__(self, name, stream, clock, seq):
        self.name, self.stream, self.clock, self.seq = name, stream, clock, seq


class FakeStream:
    __slots__ = ("cuda", "name", "cuda_stream", "device_index", "clock", "ops")

    def __init__(self, cuda: "FakeCuda", name: str, raw: int):
        self.cuda, self.name, self.cuda_stream, self.device_index = cuda, name, raw, 0
        self.clock = {}  # stream name -> ops of that stream this stream is ordered after (inclusive)
        self.ops = []

    def enqueue(self, name: str) -> Op:
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        self.cuda.seq += 1
        op = Op(name, self, dict(self.clock), self.cuda.seq)
        self.ops.append(op)
        return op

    def wait_event(self, event) -> None:
        self.cuda.calls += 1
        event.wait(self)

    def wait_stream(self, stream) -> None:
        self.cuda.calls += 1
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        self.cuda.calls += 1
        event = event if event is not None else self.cuda.Event()
        event.record(self)
        return event

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    __slots__ = ("cuda", "clock", "recorded_on")

    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.clock, self.recorded_on = cuda, None, None
        cuda.calls += 1
        cuda.events_created += 1

    def record(self, stream=None) -> None:
        self.cuda.calls += 1
        if not self.cuda.ordering:
            return
        stream = stream if stream is not None else self.cuda.current
        self.clock, self.recorded_on = dict(stream.clock), stream

    def wait(self, stream=None) -> None:
        self.cuda.calls += 1
        if not self.cuda.ordering:
            return
        stream = stream if stream is not None else self.cuda.current
        assert self.clock is not None, "waiting for an event that was never recorded"
        for name, n in self.clock.items():
            if stream.clock.get(name, 0) < n:
                stream.clock[name] = n


class FakeCuda:
    """Installs the fakes (a context manager); `compute` is the current stream unless changed with
    torch.cuda.stream(...). ordering=False skips the vector clocks (for timing: the fakes then cost little
    more than the Python calls that reach them)."""

    def __init__(self, ordering: bool = True):
        self.ordering = ordering
        self.calls = 0            # torch.cuda stream/event calls made by the code under test
        self.seq = 0              # ops enqueued so far, on every stream (the host's order)
        self.events_created = 0
        self.record_stream_calls = []  # (tensor, stream)
        self.stream_contexts = []      # streams made current by torch.cuda.stream(...)
        self.capturing = False         # what the capture query answers (a test sets it to fake a CUDA-graph capture)
        self.capture_queries = 0
        self.streams = {}
        self.compute = self.new_stream("compute")
        self.current = self.compute
        self._stack = contextlib.ExitStack()
        fake = self

        class Event(FakeEvent):
            __slots__ = ()

            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                super().__init__(fake)

        self.Event = Event

    def new_stream(self, name: str) -> FakeStream:
        s = FakeStream(self, name, 0x1000 + 0x100 * len(self.streams))
        self.streams[s.cuda_stream] = s
        return s

    # ---- the replaced entry points ------------------------------------------------------------------------------
    def current_stream(self, device=None):
        self.calls += 1
        return self.current

    def raw_current_stream(self, device_index=None):
        self.calls += 1
        return self.current.cuda_stream

    @contextlib.contextmanager
    def stream(self, s):
        self.calls += 1
        self.stream_contexts.append(s)
        saved, self.current = self.current, s
        try:
            yield
        finally:
            self.current = saved

    def is_current_stream_capturing(self):
        self.capture_queries += 1
        return self.capturing

    def record_stream(self, tensor, stream):
        self.record_stream_calls.append((tensor, stream))

    @staticmethod
    def event_record(event, stream):
        event.record(stream)

    @staticmethod
    def event_wait(event, stream):
        event.wait(stream)

    # ---- installation -------------------------------------------------------------------------------------------
    def __enter__(self):
        import epx._streams as streams
        from epx import event as event_module
        s = self._stack
        fake = self
        s.enter_context(_patch(torch.cuda, "current_stream", self.current_stream))
        s.enter_context(_patch(torch.cuda, "stream", self.stream))
        s.enter_context(_patch(torch.cuda, "Event", self.Event))
        s.enter_context(_patch(torch.Tensor, "record_stream", lambda t, stream: fake.record_stream(t, stream)))
        # The raw entry points epx._streams binds once (present after the host-overhead work).
        for name, value in (("_raw_current_stream", self.raw_current_stream), ("_event_record", self.event_record),
                            ("_event_wait", self.event_wait), ("_new_event", self.Event),
                            ("_stream_context", self.stream), ("_current_stream", self.current_stream)):
            if hasattr(streams, name):
                s.enter_context(_patch(streams, name, value))
        for name, value in (("_current_stream", self.current_stream),):
            if hasattr(event_module, name):
                s.enter_context(_patch(event_module, name, value))
        try:
            import epx._output_pool as output_pool
        except ImportError:  # a tree without the output pool
            output_pool = None
        if output_pool is not None:
            s.enter_context(_patch(output_pool, "_is_capturing", self.is_current_stream_capturing))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    @contextlib.contextmanager
    def builtin_noops(self):
        """For timing: the raw entry points of epx._streams become C builtins that do nothing (an event's
        record and wait: operator.is_; the current stream: dict.get), so that they cost what a call of
        torch's C functions costs in Python, without its CUDA work, and no Python frame of a fake. The capture
        query becomes bool (a builtin answering False). The current stream must not change meanwhile, and nothing
        is counted or ordered."""
        import epx._streams as streams
        with contextlib.ExitStack() as s:
            for name, value in (("_raw_current_stream", {0: self.current.cuda_stream}.get),
                                ("_current_stream", {0: self.current}.get),
                                ("_event_record", operator.is_), ("_event_wait", operator.is_)):
                if hasattr(streams, name):
                    s.enter_context(_patch(streams, name, value))
            try:
                import epx._output_pool as output_pool
            except ImportError:
                output_pool = None
            if output_pool is not None:
                s.enter_context(_patch(output_pool, "_is_capturing", bool))
            yield


@contextlib.contextmanager
def _patch(obj, name, value):
    missing = object()
    saved = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, saved)


def after(b: Op, a: Op) -> bool:
    """True when operation b is ordered after operation a on the device."""
    return b.clock.get(a.stream.name, 0) >= a.clock[a.stream.name]


def struct_of(arg):
    """The ctypes struct a pointer argument of a spied library call points to: epx passes some structs as they are
    and others through byref()."""
    return getattr(arg, "_obj", arg)


# ---- the stub library --------------------------------------------------------------------------------------------
_stub_path = None


def stub_path() -> str:
    """Compiles stub_epx.c once per process (into a folder removed at exit); -> the .so path. Raises
    RuntimeError without a C compiler."""
    global _stub_path
    if _stub_path is None:
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            raise RuntimeError("no C compiler (cc) to build the stub library")
        out_dir = tempfile.mkdtemp(prefix="epx-stub-")
        atexit.register(shutil.rmtree, out_dir, True)
        path = os.path.join(out_dir, "libepx_stub.so")
        subprocess.check_call([cc, "-shared", "-fPIC", "-O2", "-I", os.path.join(REPO, "include"),
                               os.path.join(HERE, "stub_epx.c"), "-o", path])
        _stub_path = path
    return _stub_path


@contextlib.contextmanager
def stub_library(wrap=None):
    """epx's library replaced by the stub while the context is open. wrap(name, fn) -> fn may wrap each bound
    function (the choreography tests use it to see which stream a launch was enqueued on)."""
    from epx import _lib
    library = _lib.Library(stub_path())
    if wrap is not None:
        for name in _lib.SIGNATURES:
            setattr(library, name, wrap(name, getattr(library, name)))
    saved = _lib._library
    _lib._library = library
    try:
        yield library
    finally:
        _lib._library = saved


def fake_buffer(cuda: FakeCuda, group_size: int, **kwargs):
    """A Buffer whose tensors live on the CPU, with a (stub) native pointer and a fake communication stream."""
    import epx
    from epx.buffer import _Native
    buf = epx.Buffer._unlaunched(group_size, **kwargs)
    comm = cuda.new_stream("comm")
    buf._native = _Native(0x1000, None)
    if hasattr(buf, "_attach_streams"):
        buf._attach_streams(comm)
    else:
        buf._comm_stream = comm
    return buf
