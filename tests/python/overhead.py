"""Host overhead per call of epx.Buffer's Python methods against direct ctypes calls of the same C functions.

    python tests/python/overhead.py [--nproc 2] [--calls 200] [--json out.json] [--no-pin]
    torchrun --nproc-per-node 2 tests/python/overhead.py

For cached dispatch, combine, low-latency dispatch and low-latency combine (small sizes, so that the GPU work is
short), it times N back-to-back calls with perf_counter (host time per call: argument checks, stream choreography,
output allocation and the C call) and with CUDA events (time per call on the GPU, including what the stream waits
for), once through the Python API (events on the current stream, where its results are ready) and once calling
the C function through ctypes with prebuilt argument structs and preallocated outputs (events on the communication
stream, where those calls run). Every rank makes the same calls (they are collective); rank 0
prints the slowest rank's numbers (the JSON has every rank's). The best of several repetitions is kept.
Low-latency dispatch and combine must alternate, so they are timed as a pair, and each half on its own inside the
same loop (host time only); the pair also in the rank-reduced order (the dispatch with topk_weights, the combine
with reduction="rank"; no ctypes columns: the ctypes baseline makes flat calls). Two rows at the issue's target
shapes: get_dispatch_layout at 4096 tokens, top-8 of 256 (Python against ctypes), and the low-latency pair at the
decoding shape (M tokens x 7168, top-8 of 288, FP8 dispatch with cumulative stats) in an eager loop against the same
pair replayed from a CUDA graph (its "ctypes" columns, and graph_* in the JSON). tests/python/overhead_cpu.py times
the Python side alone on a CPU.

The low-latency loops run as a decoding loop does: each call's results replace the previous call's in the loop's
names (held until then). The "(reuse)" rows repeat them with Buffer.set_low_latency_output_reuse(True) (opt-in), so
the Buffer hands out again the output sets nothing references any more (python/README.md), and the "sets reused"
column (sets_reused / sets_allocated in the JSON, rank 0's) says how many sets were handed out again.
"capture query" is the host time of the CUDA-graph capture query each low-latency call makes while reuse is on.
Each rank's process is pinned to one CPU core (--no-pin: not pinned), preferably one local to its GPU (the PCI
device's local_cpulist in sysfs); the cores are printed.
"""

import argparse
import json
import os
import pickle
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import epx
except ImportError:  # a source checkout: the package is in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    import epx

from epx import _output_pool  # noqa: E402
from epx.bootstrap import all_gather_bytes  # noqa: E402

sys.path.insert(0, HERE)
from _raw_calls import best_host_us, intranode_calls, layout_call, low_latency_calls  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK, M = 128, 2048, 32, 4, 128
DECODE_HIDDEN, DECODE_EXPERTS, DECODE_TOPK = 7168, 288, 8  # the decoding shape of the targets (M tokens)
LAYOUT_TOKENS, LAYOUT_EXPERTS, LAYOUT_TOPK = 4096, 256, 8


def timed(fn, calls, reps, stream=None):
    """-> (best host microseconds per call, best GPU microseconds per call). The events go on `stream` (a raw
    cudaStream_t, for the ctypes calls, which run there), else on the current stream (where the Python API's
    results are ready)."""
    best_host = best_gpu = float("inf")
    on = torch.cuda.ExternalStream(stream) if stream is not None else torch.cuda.current_stream()
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(on)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        end.record(on)
        torch.cuda.synchronize()
        best_host = min(best_host, (t1 - t0) / calls * 1e6)
        best_gpu = min(best_gpu, start.elapsed_time(end) / calls * 1e3)
    return best_host, best_gpu


def timed_halves(first, second, calls, reps):
    """For calls that must alternate (low-latency dispatch and combine share the buffer sets): -> best host
    microseconds per call of first, and of second, timed separately inside the same loop."""
    best_first = best_second = float("inf")
    clock = time.perf_counter
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a = b = 0.0
        for _ in range(calls):
            t0 = clock()
            first()
            t1 = clock()
            second()
            b += clock() - t1
            a += t1 - t0
        torch.cuda.synchronize()
        best_first = min(best_first, a / calls * 1e6)
        best_second = min(best_second, b / calls * 1e6)
    return best_first, best_second


def pick_core(rank: int, device: int):
    """-> (a CPU core for this rank, where the choice came from). Cores local to the GPU (sysfs local_cpulist of its
    PCI device, where torch reports the PCI address), else every core this process may use; of those, the
    (2 * rank + 2)-th (ranks of one NUMA node get distinct cores, and cores 0-1, where the system tends to run, are
    left alone), or the rank-th where there are too few."""
    allowed = sorted(os.sched_getaffinity(0))
    cores, source = allowed, "any allowed core"
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None not in ids:
        path = f"/sys/bus/pci/devices/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/local_cpulist"
        try:
            with open(path) as f:
                local = set()
                for part in f.read().strip().split(","):
                    lo, _, hi = part.partition("-")
                    local.update(range(int(lo), int(hi or lo) + 1))
            local = sorted(local & set(allowed))
            if local:
                cores, source = local, f"local to GPU {device} ({path})"
        except (OSError, ValueError):
            pass
    i = 2 * rank + 2
    return cores[i if i < len(cores) else rank % len(cores)], source


def intranode(rank, world, calls, reps):
    config = epx.Buffer.get_dispatch_config(world)
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=config.get_nvl_buffer_size_hint(HIDDEN * 2, world))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOPK, dim=1).indices.cuda()
    w = torch.rand(TOKENS, TOPK, generator=g).cuda()
    ntr, _, nte, itr, _ = buffer.get_dispatch_layout(idx, EXPERTS)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                      num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
    rows = {}

    # Python API
    rows["dispatch (cached)"] = [timed(lambda: buffer.dispatch(x, handle=handle), calls, reps)]
    rows["combine"] = [timed(lambda: buffer.combine(recv_x, handle, topk_weights=recv_w), calls, reps)]

    # Direct ctypes, on the communication stream, with everything prebuilt (comm by its raw handle:
    # get_comm_stream() would hand comm out and turn the low-latency shortcut off)
    lib, ptr, stream = epx.lib(), buffer._ptr(), buffer._streams.comm_raw
    raw_dispatch, raw_combine = intranode_calls(lib, ptr, stream, config.to_c(), epx.Buffer._handle_struct(handle), x,
                                                itr, recv_x, recv_w, w, HIDDEN, TOPK)
    rows["dispatch (cached)"].append(timed(raw_dispatch, calls, reps, stream))
    rows["combine"].append(timed(raw_combine, calls, reps, stream))
    torch.cuda.synchronize()
    buffer.destroy()
    return rows


def low_latency_setup(rank, world, hidden, experts, topk):
    """-> (a low-latency Buffer for M tokens of hidden, cleaned, x [M, hidden], topk_idx, topk_weights, the
    generator the inputs came from)."""
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(M, hidden, world, experts)
    buffer = epx.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True)
    buffer.clean_low_latency_buffer(M, hidden, experts)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(M, hidden, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(M, experts, generator=g).topk(topk, dim=1).indices.cuda()
    w = torch.rand(M, topk, generator=g).cuda()
    return buffer, x, idx, w, g


def reuse_counts(buffer):
    """-> (output sets handed out again, sets allocated) so far, low-latency dispatch and combine together."""
    counts = buffer.get_low_latency_output_reuse_counts().values()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def counted(buffer, sets, name, fn):
    """Runs fn() and records in sets[name] the output sets its calls handed out again and allocated."""
    before = reuse_counts(buffer)
    result = fn()
    after = reuse_counts(buffer)
    sets[name] = (after[0] - before[0], after[1] - before[1])
    return result


def low_latency(rank, world, calls, reps, sets):
    buffer, x, idx, w, _ = low_latency_setup(rank, world, HIDDEN, EXPERTS, TOPK)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)
    y = recv_x.clone()
    buffer.low_latency_combine(y, idx, w, handle)
    del recv_x, handle
    rows = {}
    # As a decoding loop: each call's results replace the previous call's, which stay held until then.
    held = {}

    # Python API: dispatch and combine alternate (the buffer sets must stay paired).
    def py_pair():
        held["dispatch"] = buffer.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)
        held["combine"] = buffer.low_latency_combine(y, idx, w, held["dispatch"][2])

    def py_dispatch():
        held["dispatch"] = buffer.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)

    def py_combine():
        held["combine"] = buffer.low_latency_combine(y, idx, w, held["dispatch"][2])

    # comm by its raw handle: get_comm_stream() would hand comm out and turn off the low-latency shortcut
    lib, ptr, stream = epx.lib(), buffer._ptr(), buffer._streams.comm_raw
    raw_dispatch, raw_combine = low_latency_calls(lib, ptr, stream, x, idx, w, y, HIDDEN, TOPK, EXPERTS, M, world)

    def raw_pair():
        raw_dispatch()
        raw_combine()

    raw = timed(raw_pair, calls, reps, stream)
    raw_halves = timed_halves(raw_dispatch, raw_combine, calls, reps)
    nan = float("nan")  # the halves have no GPU time of their own (they run interleaved)
    for suffix, reuse in (("", False), (" (reuse)", True)):
        buffer.set_low_latency_output_reuse(reuse)
        name = "low-latency dispatch + combine" + suffix
        rows[name] = [counted(buffer, sets, name, lambda: timed(py_pair, calls, reps)), raw]
        py_halves = counted(buffer, sets, "  of which dispatch" + suffix,
                            lambda: timed_halves(py_dispatch, py_combine, calls, reps))
        rows["  of which dispatch" + suffix] = [(py_halves[0], nan), (raw_halves[0], nan)]
        rows["  of which combine" + suffix] = [(py_halves[1], nan), (raw_halves[1], nan)]
    # The rank-reduced order (SPEC section 5): the dispatch carries the weights, the combine sums per expert rank.
    # No ctypes columns (the ctypes baseline makes flat calls).
    buffer.set_low_latency_output_reuse(False)

    def py_rank_dispatch():
        held["dispatch"] = buffer.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False, topk_weights=w)

    def py_rank_combine():
        held["combine"] = buffer.low_latency_combine(y, idx, w, held["dispatch"][2], reduction="rank")

    name = "low-latency dispatch + combine, reduction='rank'"
    rows[name] = [timed(lambda: (py_rank_dispatch(), py_rank_combine()), calls, reps), (nan, nan)]
    rank_halves = timed_halves(py_rank_dispatch, py_rank_combine, calls, reps)
    rows["  of which dispatch (with weights)"] = [(rank_halves[0], nan), (nan, nan)]
    rows["  of which combine, reduction='rank'"] = [(rank_halves[1], nan), (nan, nan)]
    held.clear()
    torch.cuda.synchronize()
    buffer.destroy()
    return rows


def capture_query(calls, reps):
    """Host time of the capture query the low-latency calls make while output reuse is on (no GPU time)."""
    best = best_host_us(_output_pool._is_capturing, calls, reps)
    nan = float("nan")
    return {"capture query (host only)": [(best, nan), (nan, nan)]}


def layout(rank, world, calls, reps):
    """get_dispatch_layout at 4096 tokens, top-8 of 256 (local; every rank times its own)."""
    buffer = epx.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(LAYOUT_TOKENS, LAYOUT_EXPERTS, generator=g).topk(LAYOUT_TOPK, dim=1).indices.cuda()
    rows = {"get_dispatch_layout 4096 top-8/256": [timed(lambda: buffer.get_dispatch_layout(idx, LAYOUT_EXPERTS),
                                                           calls, reps)]}
    lib, ptr, stream = epx.lib(), buffer._ptr(), buffer._streams.comm_raw
    rows["get_dispatch_layout 4096 top-8/256"].append(timed(layout_call(lib, ptr, stream, idx, LAYOUT_EXPERTS, world),
                                                            calls, reps, stream))
    torch.cuda.synchronize()
    buffer.destroy()
    return rows


def decode(rank, world, calls, reps, sets):
    """The low-latency pair at the decoding shape (M tokens x 7168, top-8 of 288, FP8 dispatch with cumulative
    stats): an eager Python loop against the same pair captured once in a CUDA graph and replayed."""
    buffer, x, idx, w, g = low_latency_setup(rank, world, DECODE_HIDDEN, DECODE_EXPERTS, DECODE_TOPK)
    stats = torch.zeros(DECODE_EXPERTS // world, dtype=torch.int32, device="cuda")
    y = torch.randn(DECODE_EXPERTS // world, world * M, DECODE_HIDDEN, generator=g).to(torch.bfloat16).cuda()
    held = {}  # as a decoding loop: each call's results replace the previous call's

    def dispatch():
        held["dispatch"] = buffer.low_latency_dispatch(x, idx, M, DECODE_EXPERTS,
                                                       cumulative_local_expert_recv_stats=stats, use_fp8=True)

    def combine():
        held["combine"] = buffer.low_latency_combine(y, idx, w, held["dispatch"][2])

    def pair():
        dispatch()
        combine()

    name = f"decode pair {M}x{DECODE_HIDDEN} top-{DECODE_TOPK}/{DECODE_EXPERTS} fp8"
    rows = {}
    nan = float("nan")
    for suffix, reuse in (("", False), (" (reuse)", True)):
        buffer.set_low_latency_output_reuse(reuse)
        rows[name + suffix] = [counted(buffer, sets, name + suffix, lambda: timed(pair, calls, reps))]
        halves = counted(buffer, sets, "  of which dispatch (eager)" + suffix,
                         lambda: timed_halves(dispatch, combine, calls, reps))
        rows["  of which dispatch (eager)" + suffix] = [(halves[0], nan), (nan, nan)]
        rows["  of which combine (eager)" + suffix] = [(halves[1], nan), (nan, nan)]
    held.clear()
    buffer.set_low_latency_output_reuse(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pair()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads (NCCL watchdog) may query CUDA
        pair()
    replay = timed(graph.replay, calls, reps)  # the "ctypes" columns of these rows: graph replays
    rows[name].append(replay)
    rows[name + " (reuse)"].append(replay)
    held.clear()
    torch.cuda.synchronize()
    del graph
    buffer.destroy()
    return rows


def worker(rank, world, calls, reps, json_path, store_dir, pin):
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    device = rank if store_dir else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)
    pinned = "not pinned (--no-pin)"
    if pin:  # before the process group and the Buffers start their threads, which inherit the mask
        core, source = pick_core(rank if store_dir else int(os.environ.get("RANK", "0")), device)
        os.sched_setaffinity(0, {core})
        pinned = f"core {core}, {source}"
    if store_dir:
        store = dist.FileStore(os.path.join(store_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    sets = {}
    rows = intranode(rank, world, calls, reps)
    rows.update(low_latency(rank, world, calls, reps, sets))
    rows.update(layout(rank, world, calls, reps))
    rows.update(decode(rank, world, calls, reps, sets))
    rows.update(capture_query(calls, reps))
    # all_gather_bytes rather than all_gather_object, which lets go of its tensors while a gloo worker thread may
    # still hold them: with every rank pinned to one core that thread then needed the GIL during the interpreter's
    # exit and aborted the process (epx/bootstrap.py, _hold).
    pins = [pickle.loads(b) for b in all_gather_bytes(None, None, pickle.dumps(pinned))]
    # Every rank's numbers: the table gives the slowest rank's (the calls are collective, so the slowest host
    # paces every GPU), the JSON each rank's too.
    per_rank = [pickle.loads(b) for b in all_gather_bytes(None, None, pickle.dumps(rows))]
    rows = {name: [tuple(max(r[name][i][j] for r in per_rank) for j in range(2)) for i in range(2)] for name in rows}
    if rank == 0:
        for r, p in enumerate(pins):
            print(f"rank {r}: {p}")
        print(f"{world} ranks, {calls} calls x {reps} repetitions (best), tokens {TOKENS}, hidden {HIDDEN}, "
              f"experts {EXPERTS}, top-{TOPK}; microseconds per call, slowest rank; output reuse "
              f"{'available' if _output_pool.AVAILABLE else 'NOT available with this torch'} "
              f"(torch {torch.__version__})")
        print(f"{'operation':44} {'python host':>12} {'ctypes host':>12} {'overhead':>9} {'python gpu':>11} "
              f"{'ctypes gpu':>11} {'sets reused':>14}")
        print("(decode pair: the second pair of columns is the pair replayed from a CUDA graph; sets reused: rank 0's "
              "output sets handed out again / all sets)")
        for name, ((py_host, py_gpu), (raw_host, raw_gpu)) in rows.items():
            reused, allocated = sets.get(name, (0, 0))
            column = f"{reused}/{reused + allocated}" if reused + allocated else "-"
            print(f"{name:44} {py_host:12.1f} {raw_host:12.1f} {py_host - raw_host:9.1f} {py_gpu:11.1f} "
                  f"{raw_gpu:11.1f} {column:>14}")
        if json_path:
            with open(json_path, "w") as f:
                other = lambda name: "graph" if name.startswith("decode pair") else "ctypes"  # noqa: E731
                out = {name.strip(): {"python_host_us": v[0][0], "python_gpu_us": v[0][1],
                                      f"{other(name)}_host_us": v[1][0], f"{other(name)}_gpu_us": v[1][1],
                                      "per_rank": [r[name] for r in per_rank]}
                       for name, v in rows.items()}
                for name, (reused, allocated) in sets.items():
                    out[name.strip()].update(sets_reused=reused, sets_allocated=allocated)
                out["pinned"] = pins
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--no-pin", action="store_true", help="do not pin each rank's process to a CPU core")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # torchrun
        worker(0, 0, args.calls, args.reps, args.json, "", not args.no_pin)
        return
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as store_dir:
        mp.spawn(worker, args=(args.nproc, args.calls, args.reps, args.json, store_dir, not args.no_pin),
                 nprocs=args.nproc)


if __name__ == "__main__":
    main()
