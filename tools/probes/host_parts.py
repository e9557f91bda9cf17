"""Host cost of each piece the low-latency Python calls are made of, on one GPU (issue 28: where the host time goes).

    PYTHONPATH=python python3 tools/probes/host_parts.py [--json out.json]

Times every statement below with timeit (best of 7 repetitions, ns per execution) on CUDA tensors of the decoding
shape (128 tokens x 7168, top-8 of 288, 2 ranks: 144 local experts, 256 rows each): the argument checks, the stream
queries, the output allocations of a dispatch (and ways of making the same tensors from fewer allocations), the
objects each call makes, and ctypes calls of the library (a call that fails at its first check: argument
conversion and the status path, no launch). Needs the library (EPX_LIBRARY or an installed epx) only for the
ctypes rows. No collective: one process, one GPU. The sums at the end add the rows that make up one call's
Python side; overhead.py measures the calls themselves.
"""

import argparse
import ctypes
import json
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))

L, ROWS, H, R, M, K, T = 144, 256, 7168, 2, 128, 8, 128
GROUPS = H // 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (a dry run on a machine without a GPU)")
    args = parser.parse_args()
    d = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(0)
    bf16, fp8, f32, i32, i64, u8 = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64,
                                    torch.uint8)
    p = {dt: torch.empty(0, dtype=dt, device=d) for dt in (bf16, fp8, f32, i32, i64, u8)}
    x = torch.randn(T, H).to(bf16).to(d)
    topk = torch.zeros(T, K, dtype=i64, device=d)
    xs = x.shape
    raw_cur = torch._C._cuda_getCurrentRawStream
    capturing = torch._C._cuda_isCurrentStreamCapturing
    scale_shape, scale_strides = (L, ROWS, GROUPS), (GROUPS * ROWS, 1, ROWS)
    small_i32 = L + L * ROWS + 2 * L * R + R * M * K * 2  # count, src_info, layout_range (int64), topk_slots

    def five_allocs():
        return (p[fp8].new_empty(L, ROWS, H), p[f32].new_empty_strided(scale_shape, scale_strides),
                p[i32].new_empty(L), p[i32].new_empty(L, ROWS), p[i64].new_empty(L, R))

    def small_block():  # x and scales on their own, the three small outputs carved from one int32 block
        blk = p[i32].new_empty(L + L * ROWS + 2 * L * R)
        return (p[fp8].new_empty(L, ROWS, H), p[f32].new_empty_strided(scale_shape, scale_strides),
                blk.as_strided((L,), (1,), 0), blk.as_strided((L, ROWS), (ROWS, 1), L),
                blk.view(i64).as_strided((L, R), (R, 1), (L + L * ROWS + 1) // 2))

    g = dict(globals(), **locals())
    from epx import event as _event
    from epx import _lib
    g.update(EventOverlap=_event.EventOverlap, LLHandle=_lib.LLHandle, LLArgs=_lib.LLDispatchArgs,
             args_s=_lib.LLDispatchArgs(), outs_s=_lib.LLDispatchOutputs(), h_s=_lib.LLHandle())
    try:
        lib = _lib.lib()
        g.update(lib=lib, ll_dispatch=lib.epx_ll_dispatch, version=getattr(lib, "epx_version", None))
    except Exception as e:  # noqa: BLE001 - the ctypes rows are optional
        print(f"library not loaded ({e}); ctypes rows skipped")
        lib = None

    rows = [
        ("check", "isinstance(x, torch.Tensor)"),
        ("check", "x.dtype is bf16"),
        ("check", "x.device == d"),
        ("check", "x.is_contiguous()"),
        ("check", "x.shape"),
        ("check", "x.shape == xs"),
        ("check", "x.data_ptr()"),
        ("check", "x.data_ptr() & 15"),
        ("stream", "raw_cur(0)"),
        ("stream", "capturing()"),
        ("stream", "torch.cuda.current_stream(0)"),
        ("alloc", "p[fp8].new_empty(L, ROWS, H)"),
        ("alloc", "p[f32].new_empty_strided(scale_shape, scale_strides)"),
        ("alloc", "p[i32].new_empty(L)"),
        ("alloc", "p[i32].new_empty(L, ROWS)"),
        ("alloc", "p[i64].new_empty(L, R)"),
        ("alloc", "p[bf16].new_empty(T, H)"),
        ("alloc", "torch.empty((T, H), dtype=bf16, device=d)"),
        ("alloc", "p[i32].new_empty(small_i32)"),
        ("alloc", "five_allocs()"),
        ("alloc", "small_block()"),
        ("view", "x.as_strided((T, H), (H, 1), 0)"),
        ("view", "x.view(torch.int16)"),
        ("view", "x.view(T * H)"),
        ("view", "x.narrow(0, 0, 64)"),
        ("object", "EventOverlap()"),
        ("object", "LLHandle()"),
        ("object", "LLArgs(None, T, H, None, K, 288, M, True, False, False, None)"),
        ("object", "args_s.num_tokens = T"),
        ("object", "args_s.x = 1234567"),
    ]
    if lib is not None:
        rows.append(("ctypes", "ll_dispatch(None, args_s, outs_s, 3, h_s, 0)"))
    results = []
    for kind, stmt in rows:
        try:
            t = timeit.Timer(stmt, globals=g)
            ns = min(t.repeat(repeat=7, number=args.number)) / args.number * 1e9
        except Exception as e:  # noqa: BLE001 - a statement this torch lacks is reported, not fatal
            print(f"{kind:7} {stmt:70} failed: {e}")
            continue
        results.append({"kind": kind, "stmt": stmt, "ns": ns})
        print(f"{kind:7} {stmt:70} {ns:8.1f} ns")
    device = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__}, {device}, python {sys.version.split()[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
