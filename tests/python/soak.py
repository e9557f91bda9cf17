"""A long mixed run on 2 GPUs (issue 30 item 4): intranode dispatch / combine and low-latency steps, shapes drawn
per iteration, every result checked, device memory compared between start and end.

    python tests/python/soak.py [--iterations 10000] [--check-every 64] [--nproc 2] [--seed 1] [--json FILE]

Every iteration runs one high-throughput step and one low-latency step on two Buffers (one per mode), with what
is drawn from the iteration's seed (the same on every rank, so the collective calls match):
- high-throughput: tokens per rank (0, 1 or 2..256, each rank its own), hidden 128..4096, BF16 or FP8 (with
  scales), top-k 1..8 of 16..64 experts with -1 slots (none, some, most); a normal dispatch, a cached dispatch of
  new data over the previous routing, or a worst-case dispatch (num_worst_tokens, no CPU sync); then a combine
  of the received rows.
- low-latency: tokens per rank 0, 1 or 2..M, top-k 1..8, BF16 or FP8 dispatch; plain calls, calls with the
  receive hook, a double-buffered pair (the second dispatch sent before the first combine is received), or a
  replay of a CUDA graph of dispatch + combine captured at the start.
Checks. Every iteration, on the GPU: the combine of the received rows themselves is, bit for bit, each token's
row times the number of ranks that received it, +0.0 where that is a zero (section 3 sums from 0.0f)
(high-throughput), and the top-k weighted sum of its own row in slot order (low-latency, BF16 dispatch);
received row counts match the handle. The first wrong combines print evidence: the first differing element,
the token's routing, and the same combine by _ref.combine. Every --check-every iterations,
on the CPU: every output against the reference model (_ref.py: rows, top-k ids and weights, per-expert counts,
the prefix matrix, FP8 data and scales, the low-latency layout and source indices, the FP8 combine).
Memory: cudaMemGetInfo and the caching allocator's numbers after the set-up and warm-up (the first
iterations load every kernel and fill the allocator's pools) and at the end, with the soak's own tensors dropped
and torch's cached free blocks released (torch.cuda.empty_cache; the low-latency output sets the Buffer keeps for
reuse are dropped first):
device memory outside torch's allocator must not grow by more than 2 MiB, and the allocated bytes by no more than
64 KiB (what the Buffers keep of the last shapes; a repeating leak exceeds it).
Rank 0 prints progress every 1000 iterations and a summary; the exit status is 1 when any rank saw a wrong
result, a failure or growth.
"""

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import epx
except ImportError:  # a source checkout: the package is in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    import epx
sys.path.insert(0, HERE)
import _ref  # noqa: E402

H_MAX = 4096
HIDDENS = (128, 256, 512, 1024, 2048, 4096)
T_MAX = 256
POOL = 2048          # rows of the input pools every rank builds alike
M, LL_H, LL_E = 64, 2048, 32
GRAPH_T, GRAPH_K = 48, 4
WARMUP = 64          # iterations before the memory is read at the start
GROWTH_LIMIT = 2 << 20
# torch's allocated bytes may differ by what the last iteration's state holds (the Buffers keep a few small
# tensors of the last shapes); a leak repeats, and one leaked allocation (>= 512 B) per 128 of 10,000 iterations
# already exceeds this.
ALLOC_GROWTH_LIMIT = 64 << 10
EVIDENCE = 4         # wrong combines per rank reported with their evidence (combine_evidence)


class Pools:
    """Input rows: every rank builds the same pools once (CPU and GPU copies, identical bytes), and an iteration's
    x is a random choice of pool rows, so any rank rebuilds any rank's inputs cheaply."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(12345)
        self.bf16 = (torch.randn(POOL, H_MAX, generator=g) * 2).to(torch.bfloat16)
        self.fp8 = _ref.as_fp8(self.bf16.float() * 64)
        self.scales = torch.rand(POOL, H_MAX // 128, generator=g) + 0.1
        self.gpu = {k: getattr(self, k).to(device) for k in ("bf16", "fp8", "scales")}


def tokens(rng, t_max):
    u = rng.random()
    return 0 if u < 0.08 else 1 if u < 0.16 else rng.randint(2, t_max)


def routing(seed, rank, num_tokens, num_experts, num_topk, empty_prob):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    rows = torch.randint(0, POOL, (num_tokens,), generator=g)
    idx = torch.rand(num_tokens, num_experts, generator=g).topk(num_topk, dim=1).indices
    empty = torch.rand(num_tokens, num_topk, generator=g) < empty_prob
    idx = torch.where(empty, torch.full_like(idx, -1), idx)
    w = torch.where(empty, torch.zeros(num_tokens, num_topk), torch.rand(num_tokens, num_topk, generator=g) + 0.5)
    return rows, idx, w


class Soak:
    def __init__(self, rank, world, args):
        self.rank, self.world, self.args = rank, world, args
        self.device = torch.device("cuda", rank)
        self.pools = Pools(self.device)
        configs = [epx.Buffer.get_dispatch_config(world), epx.Buffer.get_combine_config(world)]
        nvl = max(c.get_nvl_buffer_size_hint(H_MAX * 2, world) for c in configs)
        self.ht = epx.Buffer(dist.group.WORLD, num_nvl_bytes=nvl, explicitly_destroy=True)
        rdma = epx.Buffer.get_low_latency_rdma_size_hint(M, LL_H, world, LL_E)
        self.ll = epx.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True, explicitly_destroy=True)
        self.ll.set_low_latency_output_reuse(True)  # the opt-in path: checks, hooks, graphs go through reused sets
        self.ll.clean_low_latency_buffer(M, LL_H, LL_E)
        for b in (self.ht, self.ll):
            b.set_timeout(30.0)
        self.prev = None      # the previous high-throughput dispatch (for a cached one)
        self.wrong = []       # (iteration, what) of every wrong result on this rank
        self.evidence = []    # the details of the first EVIDENCE wrong combines
        self.phase = {}       # seconds per phase of the timed iterations (the report's phase_seconds)
        self.checked = 0
        self.graph = None

    # ---- high-throughput ------------------------------------------------------------------------------------------
    def ht_shape(self, it, rng):
        s = {"hidden": rng.choice(HIDDENS), "fp8": rng.random() < 0.3, "topk": rng.choice((1, 2, 4, 8)),
             "experts": rng.choice((16, 32, 64)), "empty": rng.choice((0.0, 0.2, 0.6)),
             "tokens": [tokens(rng, T_MAX) for _ in range(self.world)], "seed": it}
        mode = rng.random()
        s["mode"] = "cached" if mode < 0.25 else "worst" if mode < 0.5 else "normal"
        return s

    def ht_inputs(self, s, rank, data_seed, gpu):
        rows, idx, w = routing(s["seed"], rank, s["tokens"][rank], s["experts"], s["topk"], s["empty"])
        rows = (rows * 31 + data_seed) % POOL  # new data over the same routing (cached dispatch)
        pools = self.pools.gpu if gpu else vars(self.pools)
        if gpu:
            rows = rows.to(self.device)
        x = pools["fp8" if s["fp8"] else "bf16"][rows, :s["hidden"]]
        if s["fp8"]:
            x = (x, pools["scales"][rows, :s["hidden"] // 128])
        if gpu:
            return x, idx.to(self.device), w.to(self.device)
        return x, idx, w

    def ht_step(self, it, rng, check):
        s = self.ht_shape(it, rng)
        data_seed = it
        if s["mode"] == "cached":
            if self.prev is None:
                s["mode"] = "normal"
            else:
                s = dict(self.prev["shape"], mode="cached", worst_handle=self.prev["shape"]["mode"] == "worst")
        if s["mode"] == "worst" and sum(s["tokens"]) == 0:
            s["mode"] = "normal"
        x, idx, w = self.ht_inputs(s, self.rank, data_seed, gpu=True)
        b = self.ht
        if s["mode"] == "cached":
            handle = self.prev["handle"]
            recv_x = b.dispatch(x, handle=handle)[0]
            recv_idx = recv_w = per_expert = None
            itr = self.prev["itr"]
        else:
            ntr, _, nte, itr, _ = b.get_dispatch_layout(idx, s["experts"])
            worst = sum(s["tokens"]) if s["mode"] == "worst" else 0
            recv_x, recv_idx, recv_w, per_expert, handle, _ = b.dispatch(
                x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                topk_weights=w, num_worst_tokens=worst)
            self.prev = {"shape": s, "handle": handle, "itr": itr}
        data = recv_x[0] if s["fp8"] else recv_x
        y = data.to(torch.bfloat16)  # fp8 -> bf16 is exact
        combined, _, _ = b.combine(y, handle)
        # Cheap invariants, on the GPU: combined = own row x (ranks that received it), exactly; row counts.
        # Section 3: acc = 0.0f, then acc += row for every receiving rank: 0.0f + (-0.0f) is +0.0f, so a -0.0
        # element (FP8 data underflows to it) and a token no rank received (the product 0 * negative is -0.0)
        # give +0.0. The product is exact (at most 8 ranks, 8-bit significands); adding it to +0.0 gives the
        # same bits as the ascending sum.
        own = (x[0] if s["fp8"] else x).to(torch.bfloat16)
        product = own.float() * itr.sum(1, keepdim=True).float()
        want = (torch.zeros_like(product) + product).to(torch.bfloat16)
        ok = torch.equal(combined.view(torch.int16), want.view(torch.int16))
        if not ok:
            what = f"high-throughput combine ({s['mode']}, {self.describe(s)})"
            if len(self.evidence) < EVIDENCE:
                what += ": " + self.combine_evidence(s, data_seed, combined, want, itr, idx, check)
            self.wrong.append((it, what))
        rows_expected = int(handle[0][-1, self.rank])
        padded = s["mode"] == "worst" or s.get("worst_handle", False)  # outputs sized to num_worst_tokens
        if not padded and data.shape[0] != rows_expected:
            self.wrong.append((it, f"dispatch rows {data.shape[0]}, prefix matrix says {rows_expected}"))
        if check or (not ok and len(self.evidence) <= EVIDENCE):  # a wrong combine: is the dispatch right?
            self.ht_check(it, s, data_seed, recv_x, recv_idx, recv_w, per_expert, handle)

    def combine_evidence(self, s, data_seed, combined, want, itr, idx, check):
        """What a wrong combine looks like, and the same combine by the reference model (_ref.combine, section 3,
        from inputs rebuilt on the CPU: the dispatch's rows come back unchanged): tells a wrong invariant from a
        wrong library. The dispatch of this iteration is checked against _ref too (ht_check)."""
        got_bits, want_bits = combined.view(torch.int16), want.view(torch.int16)
        bad = (got_bits != want_bits).nonzero()
        t, col = (int(v) for v in bad[0])
        x_cpu, idx_cpu, _ = self.ht_inputs(s, self.rank, data_seed, gpu=False)
        own_cpu = (x_cpu[0] if s["fp8"] else x_cpu).to(torch.bfloat16)
        in_rank = _ref.layout(idx_cpu, s["experts"], self.world)[2]
        ref = _ref.combine([own_cpu] * self.world, in_rank)
        got_cpu = combined.cpu()
        lib_vs_ref = (got_cpu.view(torch.int16) != ref.view(torch.int16))
        want_vs_ref = (want.cpu().view(torch.int16) != ref.view(torch.int16))
        bad_got = got_cpu.view(torch.int16)[bad[:, 0], bad[:, 1]]
        bad_want = want_bits[bad[:, 0], bad[:, 1]].cpu()
        signed_zeros = bool(((bad_got & 0x7FFF) == 0).all() and ((bad_want & 0x7FFF) == 0).all())

        def val(v):
            return f"{float(v):g} (0x{int(v.view(torch.int16)) & 0xFFFF:04x})"

        first_lib = lib_vs_ref.nonzero()[:1].tolist()
        text = (f"{bad.shape[0]} elements in {bad[:, 0].unique().numel()} tokens differ from the invariant"
                f"{' (all are +0.0 vs -0.0)' if signed_zeros else ''}; first token {t} column {col}: want "
                f"{val(want[t, col])}, got {val(combined[t, col])}, own row {val(own_cpu[t, col])}; itr row "
                f"{itr[t].int().tolist()} (reference {in_rank[t].int().tolist()}), topk row {idx[t].tolist()}; "
                f"against _ref.combine: the library differs in {int(lib_vs_ref.sum())} elements"
                f"{f' (first token, column {first_lib[0]}: got {val(got_cpu[first_lib[0][0], first_lib[0][1]])}, ref {val(ref[first_lib[0][0], first_lib[0][1]])})' if first_lib else ''}, "
                f"the invariant in {int(want_vs_ref.sum())}; is_token_in_rank "
                f"{'matches' if torch.equal(itr.cpu(), in_rank) else 'DIFFERS from'} the reference")
        self.evidence.append(text)
        return text

    def describe(self, s):
        return (f"tokens {s['tokens']} hidden {s['hidden']} {'fp8' if s['fp8'] else 'bf16'} top-{s['topk']} of "
                f"{s['experts']}, empty {s['empty']}")

    def ht_check(self, it, s, data_seed, recv_x, recv_idx, recv_w, per_expert, handle):
        self.checked += 1
        inputs = [self.ht_inputs(s, r, data_seed, gpu=False) for r in range(self.world)]
        ref = _ref.dispatch([i[1] for i in inputs], [i[2] for i in inputs], self.rank, s["experts"])
        n = len(ref.src)
        problems = []

        def same(name, got, want):
            got = got.cpu()
            if got.dtype == torch.float8_e4m3fn:
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            elif got.dtype == torch.bfloat16:
                got, want = got.view(torch.int16), want.view(torch.int16)
            if got.shape != want.shape or not torch.equal(got, want):
                problems.append(name)

        if s["fp8"]:
            same("recv_x fp8", recv_x[0][:n], _ref.gather_rows([i[0][0] for i in inputs], ref.src, s["hidden"],
                                                               torch.float8_e4m3fn))
            same("recv_x scales", recv_x[1][:n], _ref.gather_rows([i[0][1] for i in inputs], ref.src,
                                                                  s["hidden"] // 128, torch.float32))
        else:
            same("recv_x", recv_x[:n], _ref.gather_rows([i[0] for i in inputs], ref.src, s["hidden"], torch.bfloat16))
        if s["mode"] != "cached":
            same("recv_topk_idx", recv_idx[:n], ref.recv_topk_idx)
            same("recv_topk_weights", recv_w[:n], ref.recv_topk_weights)
            same("rank_prefix_matrix", handle[0], ref.rank_prefix_matrix)
            if s["mode"] == "normal" and per_expert != ref.per_expert:
                problems.append("num_recv_tokens_per_expert")
            if s["mode"] == "worst" and not bool((recv_idx[n:] == -1).all()):
                problems.append("worst-case padding rows")
        if problems:
            self.wrong.append((it, f"high-throughput {s['mode']} dispatch ({self.describe(s)}): {problems}"))

    # ---- low-latency ---------------------------------------------------------------------------------------------
    def ll_inputs(self, seed, rank, num_tokens, topk, gpu):
        rows, idx, w = routing(seed, rank, num_tokens, LL_E, topk, 0.15)
        pool = self.pools.gpu["bf16"] if gpu else self.pools.bf16
        if gpu:
            rows, idx, w = rows.to(self.device), idx.to(self.device), w.to(self.device)
        return pool[rows, :LL_H].contiguous(), idx, w

    def ll_expected(self, x, idx, w):
        """Section 5's flat order with the received rows as expert outputs, on x's device: sum over ascending k of
        w * float(row), multiply then add, one rounding (separate tensor ops: no fused multiply-add)."""
        acc = torch.zeros(x.shape[0], LL_H, device=x.device)
        for k in range(idx.shape[1]):
            acc = torch.where((idx[:, k:k + 1] >= 0), acc + w[:, k:k + 1] * x.float(), acc)
        return acc.to(torch.bfloat16)

    def ll_dequant(self, recv_x):
        data, scales = recv_x
        L = data.shape[0]
        return (data.float().view(L, -1, LL_H // 128, 128) * scales.unsqueeze(3)).view(L, -1, LL_H).to(torch.bfloat16)

    def ll_step(self, it, rng, check):
        variant = rng.choice(("plain", "plain", "hook", "double", "graph"))
        if variant == "graph":
            return self.ll_graph_step(it, rng)
        steps = 2 if variant == "double" else 1
        shapes = []
        for j in range(steps):
            shapes.append({"seed": it * 4 + j, "topk": rng.choice((1, 2, 4, 8)), "fp8": rng.random() < 0.4,
                           "tokens": [tokens(rng, M) for _ in range(self.world)]})
        b = self.ll
        calls = []
        for sh in shapes:
            x, idx, w = self.ll_inputs(sh["seed"], self.rank, sh["tokens"][self.rank], sh["topk"], gpu=True)
            calls.append({"shape": sh, "x": x, "idx": idx, "w": w})
        hook = variant != "plain"
        first = calls[0]
        first["recv"], first["count"], first["handle"], _, h = b.low_latency_dispatch(
            first["x"], first["idx"], M, LL_E, use_fp8=first["shape"]["fp8"], return_recv_hook=hook)
        if hook:
            h()
        y = self.ll_dequant(first["recv"]) if first["shape"]["fp8"] else first["recv"]
        first["out"], _, combine_hook = b.low_latency_combine(y, first["idx"], first["w"], first["handle"],
                                                              return_recv_hook=hook)
        if variant == "double":  # the next dispatch is sent while the combine is not received yet
            second = calls[1]
            second["recv"], second["count"], second["handle"], _, dispatch_hook = b.low_latency_dispatch(
                second["x"], second["idx"], M, LL_E, use_fp8=second["shape"]["fp8"], return_recv_hook=True)
            combine_hook()
            dispatch_hook()
            y2 = self.ll_dequant(second["recv"]) if second["shape"]["fp8"] else second["recv"]
            second["out"], _, _ = b.low_latency_combine(y2, second["idx"], second["w"], second["handle"])
        elif hook:
            combine_hook()
        for c in calls:
            sh = c["shape"]
            if not sh["fp8"]:
                want = self.ll_expected(c["x"], c["idx"], c["w"])
                if not torch.equal(c["out"].view(torch.int16), want.view(torch.int16)):
                    self.wrong.append((it, f"low-latency combine ({variant}, tokens {sh['tokens']}, top-{sh['topk']})"))
            if check:
                self.ll_check(it, variant, c)

    def ll_check(self, it, variant, c):
        self.checked += 1
        sh = c["shape"]
        inputs = [self.ll_inputs(sh["seed"], r, sh["tokens"][r], sh["topk"], gpu=False) for r in range(self.world)]
        L = LL_E // self.world
        blocks = _ref.ll_blocks([i[1] for i in inputs], self.rank, LL_E)
        problems = []
        count = c["count"].cpu()
        want_count = torch.tensor([sum(len(b) for b in blocks[i]) for i in range(L)], dtype=torch.int32)
        if not torch.equal(count, want_count):
            problems.append(f"recv_count {count.tolist()} != {want_count.tolist()}")
        src_info, layout_range = c["handle"][0].cpu(), c["handle"][1].cpu()
        if sh["fp8"]:
            data, scales = c["recv"][0].cpu(), c["recv"][1].cpu()
            quantized = [_ref.quantize(i[0], False) for i in inputs]
        else:
            data = c["recv"].cpu()
        for i in range(L):
            for s in range(self.world):
                begin, n = int(layout_range[i, s]) >> 32, int(layout_range[i, s]) & 0xFFFFFFFF
                toks = blocks[i][s]
                if n != len(toks):
                    problems.append(f"expert {i} source {s}: {n} rows, want {len(toks)}")
                    continue
                if not toks:
                    continue
                rows = slice(begin, begin + n)
                if not torch.equal(src_info[i, rows], torch.tensor(toks, dtype=torch.int32)):
                    problems.append(f"recv_src_info expert {i} source {s}")
                if sh["fp8"]:
                    q, sc = quantized[s]
                    if not torch.equal(data[i, rows].view(torch.uint8), q[toks].view(torch.uint8)) or \
                            not torch.equal(scales[i, rows], sc[toks]):
                        problems.append(f"fp8 rows expert {i} source {s}")
                elif not torch.equal(data[i, rows].view(torch.int16), inputs[s][0][toks].view(torch.int16)):
                    problems.append(f"rows expert {i} source {s}")
        if sh["fp8"]:  # the combine of the dequantized rows
            x, idx, w = inputs[self.rank]
            q, sc = quantized[self.rank]
            dq = (q.float().view(-1, LL_H // 128, 128) * sc.unsqueeze(2)).view(-1, LL_H).to(torch.bfloat16)
            want = self.ll_expected(dq, idx, w)
            if not torch.equal(c["out"].cpu().view(torch.int16), want.view(torch.int16)):
                problems.append("fp8 combine")
        if problems:
            self.wrong.append((it, f"low-latency {variant} (tokens {sh['tokens']}, top-{sh['topk']}, "
                                   f"{'fp8' if sh['fp8'] else 'bf16'}): {problems[:4]}"))

    def capture_graph(self):
        b = self.ll
        x, idx, w = self.ll_inputs(0, self.rank, GRAPH_T, GRAPH_K, gpu=True)
        self.static = {"x": x.clone(), "idx": idx.clone(), "w": w.clone()}
        st = self.static

        def step():
            recv_x, _, handle, _, _ = b.low_latency_dispatch(st["x"], st["idx"], M, LL_E, use_fp8=False)
            return b.low_latency_combine(recv_x, st["idx"], st["w"], handle)[0]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            st["out"] = step()

    def ll_graph_step(self, it, rng):
        x, idx, w = self.ll_inputs(it * 4 + 3, self.rank, GRAPH_T, GRAPH_K, gpu=True)
        st = self.static
        st["x"].copy_(x)
        st["idx"].copy_(idx)
        st["w"].copy_(w)
        self.graph.replay()
        if not torch.equal(st["out"].view(torch.int16), self.ll_expected(x, idx, w).view(torch.int16)):
            self.wrong.append((it, "low-latency graph replay"))

    # ---- the run -------------------------------------------------------------------------------------------------
    def memory(self):
        self.prev = None
        # The low-latency output sets the Buffer keeps for reuse (python/README.md) are the last shapes' outputs,
        # not a leak (at most 3 per call kind, pinned by tests/python/test_output_reuse_cpu.py): dropped here.
        self.ll.set_low_latency_output_reuse(False)
        self.ll.set_low_latency_output_reuse(True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # cached free blocks returned: "used" is what is allocated, in torch or outside it
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return {"used": total - free, "free": free, "total": total, "torch_reserved": reserved,
                "torch_allocated": torch.cuda.memory_allocated(self.device), "outside_torch": total - free - reserved}

    def timed(self, name, fn, *args):
        t = time.perf_counter()
        fn(*args)
        self.phase[name] = self.phase.get(name, 0.0) + time.perf_counter() - t

    def iteration(self, it):
        rng = random.Random(self.args.seed * 1_000_003 + it)
        check = it % self.args.check_every == 0
        # per phase: the GPU steps with their cheap invariants (which synchronise), and the iterations with the
        # full reference checks apart
        self.timed("high-throughput" + (" + reference check" if check else ""), self.ht_step, it, rng, check)
        self.timed("low-latency" + (" + reference check" if check else ""), self.ll_step, it, rng, check)

    def run(self):
        self.capture_graph()
        report = {"rank": self.rank, "memory_setup": self.memory()}
        for it in range(-WARMUP, 0):  # warm-up: every kernel loaded, the allocator's pools filled
            self.iteration(it)
        self.wrong.clear()  # the warm-up's results are checked too, but not counted
        self.evidence.clear()
        self.phase.clear()
        self.checked = 0
        report["memory_start"] = self.memory()
        dist.barrier()
        t0 = time.time()
        for it in range(self.args.iterations):
            self.iteration(it)
            if self.rank == 0 and (it + 1) % 1000 == 0:
                print(f"soak: {it + 1} iterations, {time.time() - t0:.0f} s, {len(self.wrong)} wrong on rank 0",
                      flush=True)
        torch.cuda.synchronize()
        report["seconds"] = time.time() - t0
        report["memory_end"] = self.memory()
        for b in (self.ht, self.ll):
            b.check()
        report.update(iterations=self.args.iterations, wrong=len(self.wrong), wrong_first=self.wrong[:10],
                      reference_checks=self.checked, evidence=self.evidence,
                      phase_seconds={k: round(v, 2) for k, v in sorted(self.phase.items())})
        return report


def worker(rank, world, args, store_dir, out_dir):
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    # the reference checks run on the CPU: one share of the cores per rank, not every core for every rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        soak = Soak(rank, world, args)
        report = soak.run()
    except Exception:  # noqa: BLE001 - reported; the peers fail on their own (timeout)
        report = {"rank": rank, "failure": traceback.format_exc()}
        soak = None
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if soak is not None and "failure" not in report:
        dist.barrier()
        soak.ht.destroy()
        soak.ll.destroy()
        dist.barrier()
        dist.destroy_process_group()


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def summarize(reports):
    bad = False
    lines = []
    for r in reports:
        if r is None or "failure" in r:
            bad = True
            lines.append(f"rank {'?' if r is None else r['rank']}: FAILED\n{'' if r is None else r['failure']}")
            continue
        start, end = r["memory_start"], r["memory_end"]
        growth = end["outside_torch"] - start["outside_torch"]
        alloc_growth = end["torch_allocated"] - start["torch_allocated"]
        ok = r["wrong"] == 0 and growth <= GROWTH_LIMIT and alloc_growth <= ALLOC_GROWTH_LIMIT
        bad |= not ok
        lines.append(
            f"rank {r['rank']}: {'PASS' if ok else 'FAIL'} {r['iterations']} iterations in {r['seconds']:.1f} s, "
            f"{r['wrong']} wrong results ({r['reference_checks']} full reference checks); device memory used "
            f"{mib(start['used'])} -> {mib(end['used'])} (after set-up {mib(r['memory_setup']['used'])}), outside "
            f"torch {mib(start['outside_torch'])} -> {mib(end['outside_torch'])} (growth {growth} B, limit "
            f"{GROWTH_LIMIT} B), torch allocated {start['torch_allocated']} -> {end['torch_allocated']} B (limit +{ALLOC_GROWTH_LIMIT} B), "
            f"reserved "
            f"{mib(start['torch_reserved'])} -> {mib(end['torch_reserved'])}")
        lines.append("    seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("phase_seconds", {}).items()))
        for it, what in r["wrong_first"]:
            lines.append(f"    iteration {it}: {what}")
    return bad, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--check-every", type=int, default=64, help="full reference check every N iterations")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default="", help="write every rank's report here")
    args = parser.parse_args()
    if args.iterations < 1 or args.check_every < 1:
        parser.error("--iterations and --check-every must be >= 1")
    if torch.cuda.device_count() < args.nproc:
        print(f"soak: needs {args.nproc} GPUs, {torch.cuda.device_count()} visible")
        return 2
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as store_dir, tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(worker, args=(args.nproc, args, store_dir, out_dir), nprocs=args.nproc, join=True)
        except Exception as e:  # noqa: BLE001 - a process died: report what the ranks wrote
            print(f"soak: a process failed: {e}")
        reports = []
        for r in range(args.nproc):
            path = os.path.join(out_dir, f"rank{r}.json")
            reports.append(json.load(open(path)) if os.path.exists(path) else None)
    bad, lines = summarize(reports)
    print(f"soak: {args.nproc} GPUs, seed {args.seed}, check every {args.check_every}")
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    print(f"soak: {'FAIL' if bad else 'PASS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
