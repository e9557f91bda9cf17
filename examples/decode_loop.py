"""A decoding loop over an MoE layer with epx's low-latency kernels, captured once in a CUDA graph.

    torchrun --nproc-per-node N examples/decode_loop.py [--steps 8] [--bf16] [--no-check]

Every step: route the batch (top-k), low_latency_dispatch it (FP8 by default: per-128 scales, received in
the packed [experts, ranks * M, hidden] layout), run the local experts as one batched matmul over the
packed rows, low_latency_combine the weighted outputs back, and feed the result into the next step. No
step synchronizes with the CPU, so the whole step is one CUDA graph replayed in a loop. With --check
(the default) each step's output is compared with a single-GPU computation of the step on every rank's
tokens.
"""

import argparse
import os

import torch
import torch.distributed as dist

import epx


class DecodeStep:
    """Static tensors and one step of the layer; step() only launches GPU work (graph-capturable)."""

    def __init__(self, buffer, rank, world, batch, hidden, num_experts, topk, max_tokens, use_fp8, seed=0):
        self.buffer, self.rank, self.world = buffer, rank, world
        self.hidden, self.num_experts, self.topk, self.max_tokens, self.use_fp8 = \
            hidden, num_experts, topk, max_tokens, use_fp8
        self.local = num_experts // world
        g = torch.Generator().manual_seed(seed)  # the same on every rank
        self.router = (torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5).cuda()
        self.all_experts = (torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
        self.experts = self.all_experts[rank * self.local:(rank + 1) * self.local].cuda().contiguous()
        self.x = torch.zeros(batch, hidden, dtype=torch.bfloat16, device="cuda")  # the graph's input
        self.out = None                                                           # the graph's output

    def route(self, x):
        probs = torch.softmax(x.float() @ self.router, dim=1)
        topk_w, topk_idx = probs.topk(self.topk, dim=1)
        return (topk_w / topk_w.sum(dim=1, keepdim=True)).contiguous(), topk_idx.contiguous()

    def expert_inputs(self, recv_x):
        """bf16 [L, R*M, H] rows for the experts (FP8 rows are dequantized with their per-128 scales)."""
        if not self.use_fp8:
            return recv_x
        data, scales = recv_x
        L, rows, H = data.shape
        return (data.float().view(L, rows, H // 128, 128) * scales.unsqueeze(3)).view(L, rows, H).to(torch.bfloat16)

    def step(self):
        topk_w, topk_idx = self.route(self.x)
        recv_x, _, handle, _, _ = self.buffer.low_latency_dispatch(
            self.x, topk_idx, self.max_tokens, self.num_experts, use_fp8=self.use_fp8)
        # One batched matmul over every packed row; rows past each expert's count are never read back.
        y = torch.bmm(self.expert_inputs(recv_x), self.experts)
        self.out, _, _ = self.buffer.low_latency_combine(y, topk_idx, topk_w, handle)
        return self.out

    def advance(self):
        """The next step's input: the layer's output, renormalised (a stand-in for the rest of the model)."""
        nxt = self.out.float()
        self.x.copy_((nxt / nxt.norm(dim=1, keepdim=True).clamp_min(1e-6) * self.hidden ** 0.5).to(torch.bfloat16))


def reference_step(all_x, sizes, step: DecodeStep):
    """One step over every rank's tokens on one GPU: float32 sums of bf16 expert outputs."""
    experts = step.all_experts.cuda()
    probs = torch.cat([torch.softmax(chunk.float() @ step.router, dim=1) for chunk in all_x.split(sizes)])
    topk_w, topk_idx = probs.topk(step.topk, dim=1)
    topk_w = topk_w / topk_w.sum(dim=1, keepdim=True)
    x = all_x
    if step.use_fp8:  # the same per-128 quantization as the kernels, then dequantized
        T, H = x.shape
        v = x.float().view(T, H // 128, 128)
        amax = v.abs().amax(dim=2, keepdim=True).clamp_min(1e-4)
        scale = amax / torch.full_like(amax, 448.0)
        q = (v / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        x = (q.float() * scale).view(T, H).to(torch.bfloat16)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(step.topk):
        h = torch.bmm(x.unsqueeze(1), experts[topk_idx[:, k]]).squeeze(1)
        out = out + topk_w[:, k:k + 1] * h.float()
    return out


def make_buffer(group, world, max_tokens, hidden, num_experts):
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    return epx.Buffer(group, num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world)


def run(rank, world, group, steps=4, check=True, batch=16, hidden=512, num_experts=None, topk=4, max_tokens=32,
        use_fp8=True, verbose=True):
    """Runs the loop through a CUDA graph; with check, returns the largest relative error of any step. num_experts:
    a multiple of world (default 8 per rank)."""
    # moe_layer.py's experts_for, repeated: each example stands alone.
    num_experts = 8 * world if num_experts is None else num_experts
    if num_experts <= 0 or num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the world size ({world})")
    buffer = make_buffer(group, world, max_tokens, hidden, num_experts)
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    step = DecodeStep(buffer, rank, world, batch, hidden, num_experts, topk, max_tokens, use_fp8)
    g = torch.Generator().manual_seed(100 + rank)
    step.x.copy_(torch.randn(batch, hidden, generator=g).to(torch.bfloat16))

    # Warm up outside the capture (allocator pools, lazy init), then capture one step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads (NCCL watchdog) may query CUDA
        step.step()

    worst = 0.0
    for i in range(steps):
        x_before = step.x.clone() if check else None
        graph.replay()
        if check:
            parts = [None] * world  # through the CPU: works on gloo and NCCL groups
            dist.all_gather_object(parts, x_before.cpu(), group=group)
            sizes = [p.shape[0] for p in parts]
            ref = reference_step(torch.cat(parts).cuda(), sizes, step)
            first = sum(sizes[:rank])
            mine = ref[first:first + batch]
            err = ((step.out.float() - mine).abs().max() / mine.abs().max().clamp_min(1e-6)).item()
            worst = max(worst, err)
            if verbose and rank == 0:
                print(f"step {i}: relative error {err:.2e}", flush=True)
        step.advance()
    torch.cuda.synchronize()
    buffer.destroy()
    return worst


TOLERANCE = 3e-2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="dispatch bf16 rows instead of FP8")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = run(rank, world, dist.group.WORLD, steps=args.steps, check=not args.no_check, use_fp8=not args.bf16)
    if not args.no_check:
        print(f"rank {rank}: largest relative error against the single-GPU reference {worst:.2e}", flush=True)
        if worst > TOLERANCE:
            raise SystemExit(f"rank {rank}: error {worst:.3g} above {TOLERANCE}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
