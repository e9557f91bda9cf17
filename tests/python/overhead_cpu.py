"""Host cost of epx.Buffer's Python methods alone, on a CPU: the GPU measurement (overhead.py) with the GPU taken
out, so that a change to the Python layer can be timed on any machine.

    python tests/python/overhead_cpu.py [--calls 2000] [--reps 7] [--json out.json]

The library is tests/python/stub_epx.c (every C function returns at once) and torch's streams and events are
fakes (_fake_cuda.py) that do no CUDA work, so what is left is the Python layer's own work: argument checks,
ctypes structs, torch allocations (on the CPU here), stream bookkeeping. Each method is timed against a
direct ctypes call of the same stub function with prebuilt structs, as overhead.py does on GPUs. Where the
code calls torch's Python wrappers (torch.cuda.current_stream, Stream.wait_stream, Event(), ...) the fakes
are Python functions too; where it calls torch's C entry points directly (epx._streams) they are C builtins
that do nothing (FakeCuda.builtin_noops). The torch.cuda column counts the stream and event calls one
method call makes: on a GPU machine each also does CUDA work (a microsecond or so, with its GIL release),
which this table does not show. The allocations column counts the tensors one call allocates (each a CUDA
caching-allocator call on a GPU, about 1.6 us there, more than the CPU allocation timed here).
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import epx
except ImportError:  # a source checkout: the package is in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    import epx

from _fake_cuda import FakeCuda, fake_buffer, stub_library  # noqa: E402
from _raw_calls import intranode_calls, layout_call, low_latency_calls  # noqa: E402

# overhead.py's shapes, on 2 ranks
WORLD, TOKENS, HIDDEN, EXPERTS, TOPK, M = 2, 128, 2048, 32, 4, 128
LAYOUT_TOKENS, LAYOUT_EXPERTS, LAYOUT_TOPK = 4096, 256, 8


def timed(fn, calls, reps):
    """Best microseconds per call over reps runs of calls calls."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def cuda_calls(cuda, fn):
    """torch.cuda stream/event calls and events created by one call of fn."""
    fn()  # warm any per-shape cache first: the steady state is what counts
    calls, events = cuda.calls, cuda.events_created
    fn()
    return cuda.calls - calls, cuda.events_created - events


class _CountAllocations(TorchDispatchMode):
    """Counts the tensor allocations (empty, empty_strided, new_empty, new_empty_strided, empty_like) made while
    it is active."""

    _ALLOCATING = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self._ALLOCATING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def allocations(fn):
    """Output tensors one call of fn allocates."""
    fn()
    with _CountAllocations() as counter:
        fn()
    return counter.count


def measure(calls, reps):
    rows = {}
    with FakeCuda(ordering=False) as cuda, stub_library() as lib:
        # ---- high-throughput ----------------------------------------------------------------------------------
        buf = fake_buffer(cuda, WORLD)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOPK, dim=1).indices
        w = torch.rand(TOKENS, TOPK, generator=g)
        ntr = torch.zeros(WORLD, dtype=torch.int32)
        nte = torch.zeros(EXPERTS, dtype=torch.int32)
        itr = torch.ones(TOKENS, WORLD, dtype=torch.bool)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                       num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)

        def py_dispatch():
            buf.dispatch(x, handle=handle)

        def py_combine():
            buf.combine(recv_x, handle, topk_weights=recv_w)

        c_config = buf.get_dispatch_config(WORLD).to_c()
        c_config.num_sms = 2 * handle[1].shape[1]
        raw_dispatch, raw_combine = intranode_calls(lib, buf._ptr(), buf._streams.comm_raw, c_config,
                                                    epx.Buffer._handle_struct(handle), x, itr, recv_x, recv_w, w,
                                                    HIDDEN, TOPK)

        rows["dispatch (cached)"] = (py_dispatch, raw_dispatch)
        rows["combine"] = (py_combine, raw_combine)

        # ---- low-latency ----------------------------------------------------------------------------------------
        ll = fake_buffer(cuda, WORLD)
        lx = torch.randn(M, HIDDEN, generator=g).to(torch.bfloat16)
        lidx = torch.rand(M, EXPERTS, generator=g).topk(TOPK, dim=1).indices
        lw = torch.rand(M, TOPK, generator=g)
        lrecv, _, lhandle, _, _ = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)
        y = lrecv.clone()

        def py_ll_dispatch():
            ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)

        def py_ll_combine():
            ll.low_latency_combine(y, lidx, lw, lhandle)

        def py_ll_pair():
            _, _, hd, _, _ = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)
            ll.low_latency_combine(y, lidx, lw, hd)

        raw_ll_dispatch, raw_ll_combine = low_latency_calls(lib, ll._ptr(), ll._streams.comm_raw, lx, lidx,
                                                            lw, y, HIDDEN, TOPK, EXPERTS, M, WORLD)

        def raw_ll_pair():
            raw_ll_dispatch()
            raw_ll_combine()

        # ---- layout -------------------------------------------------------------------------------------------------
        lay = fake_buffer(cuda, WORLD)
        lay_idx = torch.rand(LAYOUT_TOKENS, LAYOUT_EXPERTS, generator=g).topk(LAYOUT_TOPK, dim=1).indices
        lay.get_dispatch_layout(lay_idx, LAYOUT_EXPERTS)

        def py_layout():
            lay.get_dispatch_layout(lay_idx, LAYOUT_EXPERTS)

        rows["layout 4096 top-8/256"] = (py_layout, layout_call(lib, lay._ptr(), lay._streams.comm_raw, lay_idx,
                                                                LAYOUT_EXPERTS, WORLD))

        rows["low-latency dispatch"] = (py_ll_dispatch, raw_ll_dispatch)
        rows["low-latency combine"] = (py_ll_combine, raw_ll_combine)
        rows["low-latency dispatch + combine"] = (py_ll_pair, raw_ll_pair)

        results = {}
        for name, (py, raw) in rows.items():
            n_calls, n_events = cuda_calls(cuda, py)
            n_allocs = allocations(py)
            with cuda.builtin_noops():
                results[name] = {"python_us": timed(py, calls, reps), "ctypes_us": timed(raw, calls, reps),
                                 "torch_cuda_calls": n_calls, "events_created": n_events, "allocations": n_allocs}
            results[name]["overhead_us"] = results[name]["python_us"] - results[name]["ctypes_us"]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = measure(args.calls, args.reps)
    print(f"stub library, fake streams; {args.calls} calls x {args.reps} repetitions (best); tokens {TOKENS}, "
          f"hidden {HIDDEN}, experts {EXPERTS}, top-{TOPK}, {WORLD} ranks; microseconds per call")
    print(f"{'operation':32} {'python':>8} {'ctypes':>8} {'overhead':>9} {'torch.cuda calls':>17} {'new events':>11} "
          f"{'allocations':>12}")
    for name, r in results.items():
        print(f"{name:32} {r['python_us']:8.2f} {r['ctypes_us']:8.2f} {r['overhead_us']:9.2f} "
              f"{r['torch_cuda_calls']:17d} {r['events_created']:11d} {r['allocations']:12d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
