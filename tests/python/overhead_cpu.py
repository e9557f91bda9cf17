"""Host cost of epx.Buffer's Python methods alone, on a CPU: the GPU measurement (overhead.py) with the GPU taken
out, so that a change to the Python layer can be timed on any machine.

    python tests/python/overhead_cpu.py [--calls 2000] [--reps 7] [--json out.json]

The library is tests/python/stub_epx.c (every C function returns at once) and torch's streams and events are
fakes (_fake_cuda.py) that do no CUDA work, so what is left is the Python layer's own work: argument checks,
ctypes structs, torch allocations (on the CPU here), stream bookkeeping. Each method is timed against a
direct ctypes call of the same stub function with prebuilt structs, as overhead.py does on GPUs (the FP8 rows
against the BF16 call: the stub does the same for both). Where the
code calls torch's Python wrappers (torch.cuda.current_stream, Stream.wait_stream, Event(), ...) the fakes
are Python functions too; where it calls torch's C entry points directly (epx._streams) they are C builtins
that do nothing (FakeCuda.builtin_noops). The torch.cuda column counts the stream and event calls one
method call makes: on a GPU machine each also does CUDA work (a microsecond or so, with its GIL release),
which this table does not show. The allocations column counts the tensors one call allocates (each a CUDA
caching-allocator call on a GPU, about 1.6 us there, more than the CPU allocation timed here).

The low-latency rows run as a decoding loop does: each call's results replace the previous call's in the loop's
names, so the previous outputs are still held while the next call runs, and the Buffer hands out again the output
sets nothing references any more (python/README.md). The "sets reused" column gives the output sets handed out
again / allocated during the timed calls; the "(no reuse)" rows are the same calls on a Buffer with reuse off.
"""

import argparse
import json
import os
import sys

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
from _raw_calls import best_host_us, intranode_calls, layout_call, low_latency_calls  # noqa: E402

# overhead.py's shapes, on 2 ranks
WORLD, TOKENS, HIDDEN, EXPERTS, TOPK, M = 2, 128, 2048, 32, 4, 128
LAYOUT_TOKENS, LAYOUT_EXPERTS, LAYOUT_TOPK = 4096, 256, 8


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
        lx = torch.randn(M, HIDDEN, generator=g).to(torch.bfloat16)
        lidx = torch.rand(M, EXPERTS, generator=g).topk(TOPK, dim=1).indices
        lw = torch.rand(M, TOPK, generator=g)

        stats = torch.zeros(EXPERTS // WORLD, dtype=torch.int32)

        def low_latency_rows(ll):
            """-> (dispatch, combine, pair, y, FP8 dispatch with stats, combine with reduction='rank'): the calls of a
            decoding loop on Buffer ll, each call's results replacing the previous call's (held until then, as a
            loop's names hold them)."""
            held = {}
            lrecv, _, lhandle, _, _ = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)
            whandle = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False, topk_weights=lw)[2]
            y = lrecv.clone()

            def dispatch():
                held["dispatch"] = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)

            def dispatch_fp8():
                held["dispatch"] = ll.low_latency_dispatch(lx, lidx, M, EXPERTS,
                                                           cumulative_local_expert_recv_stats=stats, use_fp8=True)

            def combine():
                held["combine"] = ll.low_latency_combine(y, lidx, lw, lhandle)

            def pair():
                held["dispatch"] = ll.low_latency_dispatch(lx, lidx, M, EXPERTS, use_fp8=False)
                held["combine"] = ll.low_latency_combine(y, lidx, lw, held["dispatch"][2])

            def combine_rank():
                held["combine"] = ll.low_latency_combine(y, lidx, lw, whandle, reduction="rank")

            return dispatch, combine, pair, y, dispatch_fp8, combine_rank

        ll = fake_buffer(cuda, WORLD)
        ll.set_low_latency_output_reuse(True)  # opt-in
        py_ll_dispatch, py_ll_combine, py_ll_pair, y, py_ll_fp8, py_ll_rank = low_latency_rows(ll)
        fresh = fake_buffer(cuda, WORLD)
        fresh.set_low_latency_output_reuse(False)
        fresh_rows = low_latency_rows(fresh)

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

        rows["low-latency dispatch"] = (py_ll_dispatch, raw_ll_dispatch, ll)
        rows["low-latency combine"] = (py_ll_combine, raw_ll_combine, ll)
        rows["low-latency dispatch + combine"] = (py_ll_pair, raw_ll_pair, ll)
        rows["low-latency dispatch FP8 + stats"] = (py_ll_fp8, raw_ll_dispatch, ll)
        rows["low-latency combine, reduction='rank'"] = (py_ll_rank, raw_ll_combine, ll)
        rows["low-latency dispatch (no reuse)"] = (fresh_rows[0], raw_ll_dispatch, fresh)
        rows["low-latency combine (no reuse)"] = (fresh_rows[1], raw_ll_combine, fresh)
        rows["low-latency dispatch + combine (no reuse)"] = (fresh_rows[2], raw_ll_pair, fresh)
        rows["low-latency dispatch FP8 + stats (no reuse)"] = (fresh_rows[4], raw_ll_dispatch, fresh)

        results = {}
        for name, row in rows.items():
            py, raw = row[0], row[1]
            owner = row[2] if len(row) > 2 else None
            n_calls, n_events = cuda_calls(cuda, py)
            n_allocs = allocations(py)
            before = reuse_counts(owner)
            with cuda.builtin_noops():
                results[name] = {"python_us": best_host_us(py, calls, reps),
                                 "ctypes_us": best_host_us(raw, calls, reps), "torch_cuda_calls": n_calls, "events_created": n_events, "allocations": n_allocs}
            after = reuse_counts(owner)
            results[name]["overhead_us"] = results[name]["python_us"] - results[name]["ctypes_us"]
            if owner is not None:
                results[name]["sets_reused"] = after[0] - before[0]
                results[name]["sets_allocated"] = after[1] - before[1]
    return results


def reuse_counts(buf):
    """-> (output sets reused, allocated) so far by buf's low-latency calls, dispatch and combine together."""
    if buf is None:
        return 0, 0
    counts = buf.get_low_latency_output_reuse_counts().values()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


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
    print(f"{'operation':42} {'python':>8} {'ctypes':>8} {'overhead':>9} {'torch.cuda calls':>17} {'new events':>11} "
          f"{'allocations':>12} {'sets reused':>14}")
    for name, r in results.items():
        sets = "-"
        if r.get("sets_reused", 0) + r.get("sets_allocated", 0):
            sets = f"{r['sets_reused']}/{r['sets_reused'] + r['sets_allocated']}"
        elif "sets_reused" in r:
            sets = "off"
        print(f"{name:42} {r['python_us']:8.2f} {r['ctypes_us']:8.2f} {r['overhead_us']:9.2f} "
              f"{r['torch_cuda_calls']:17d} {r['events_created']:11d} {r['allocations']:12d} {sets:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
