"""A small Mixture-of-Experts layer trained with epx (expert parallelism, high-throughput kernels).

    torchrun --nproc-per-node N examples/moe_layer.py [--steps 5] [--no-check]

Each rank owns E / N experts. The layer routes its tokens (router + top-k), dispatches them to the ranks
of their experts, runs each local expert on the tokens it received, and combines the weighted outputs
back. Backward runs the same communication in reverse through torch.autograd.Function:
    dispatch backward = combine of the gradients with the dispatch's handle
    combine  backward = cached dispatch of the gradients with the same handle
With --check (the default) the first step's output and gradients are compared with a single-GPU
computation of the whole layer over every rank's tokens.
"""

import argparse
import os

import torch
import torch.distributed as dist

import epx


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, buffer, num_experts, out):
        ntr, _, nte, itr, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=topk_idx,
            topk_weights=topk_weights)
        ctx.buffer, ctx.handle = buffer, handle
        out["handle"] = handle  # a tuple of tensors: handed to the caller outside autograd's outputs
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w, _):
        # Every rank that received a token sends its gradient back; the source sums them (combine).
        grad_x, grad_w, _ = ctx.buffer.combine(_dense(grad_recv_x), ctx.handle, topk_weights=_dense(grad_recv_w))
        return grad_x, grad_w, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle):
        combined, _, _ = buffer.combine(y, handle)
        ctx.buffer, ctx.handle, ctx.rows = buffer, handle, y.shape[0]
        return combined

    @staticmethod
    def backward(ctx, grad):
        # Each receiving rank gets the gradient of the token's combined row: the same routing, new data.
        grad_y = ctx.buffer.dispatch(_dense(grad), handle=ctx.handle)[0]
        return grad_y, None, None


def _dense(t):
    return t.contiguous()


class MoELayer(torch.nn.Module):
    """Router replicated on every rank; experts [E, H, H] of which this rank holds [L, H, H]."""

    def __init__(self, buffer, hidden, num_experts, topk, rank, world, seed=0):
        super().__init__()
        self.buffer, self.num_experts, self.topk = buffer, num_experts, topk
        self.local = num_experts // world
        g = torch.Generator().manual_seed(seed)  # the same on every rank: the reference rebuilds all of it
        router = torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5
        experts = torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5
        self.router = torch.nn.Parameter(router.cuda())
        self.experts = torch.nn.Parameter(experts[rank * self.local:(rank + 1) * self.local].cuda().contiguous())

    def route(self, x):
        probs = torch.softmax(x.float() @ self.router, dim=1)
        topk_w, topk_idx = probs.topk(self.topk, dim=1)
        return topk_w / topk_w.sum(dim=1, keepdim=True), topk_idx

    def run_experts(self, recv_x, recv_w, recv_idx):
        out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for i in range(self.local):
            rows, slots = torch.nonzero(recv_idx == i, as_tuple=True)
            h = recv_x[rows].float() @ self.experts[i]
            out = out.index_add(0, rows, h * recv_w[rows, slots].unsqueeze(1))
        return out.to(torch.bfloat16)

    def forward(self, x):
        topk_w, topk_idx = self.route(x)
        state = {}
        recv_x, recv_w, recv_idx = _Dispatch.apply(x, topk_w, topk_idx, self.buffer, self.num_experts, state)
        y = self.run_experts(recv_x, recv_w, recv_idx)
        return _Combine.apply(y, self.buffer, state["handle"])


def reference(all_x, sizes, router, all_experts, topk):
    """The whole layer on one GPU, float32 (the epx path rounds partial sums to bf16: compare loosely).
    The router runs per rank's chunk of tokens, as on the ranks, so that top-k picks the same experts."""
    probs = torch.cat([torch.softmax(chunk.float() @ router, dim=1) for chunk in all_x.split(sizes)])
    topk_w, topk_idx = probs.topk(topk, dim=1)
    topk_w = topk_w / topk_w.sum(dim=1, keepdim=True)
    out = torch.zeros(all_x.shape, dtype=torch.float32, device=all_x.device)
    for k in range(topk):
        h = torch.bmm(all_x.float().unsqueeze(1), all_experts[topk_idx[:, k]]).squeeze(1)
        out = out + topk_w[:, k:k + 1] * h
    return out


def experts_for(world, num_experts=None):
    """num_experts, or 8 per rank when None; every rank holds the same number of experts."""
    num_experts = 8 * world if num_experts is None else num_experts
    if num_experts <= 0 or num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the world size ({world})")
    return num_experts


def make_buffer(group, hidden, world):
    configs = [epx.Buffer.get_dispatch_config(world), epx.Buffer.get_combine_config(world)]
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, world) for c in configs)
    return epx.Buffer(group, num_nvl_bytes=nvl_bytes)


def run(rank, world, group, steps=3, check=True, tokens=64, hidden=256, num_experts=None, topk=4, verbose=True):
    """Trains a few steps; with check, returns the first step's largest errors against the reference. num_experts:
    a multiple of world (default 8 per rank)."""
    num_experts = experts_for(world, num_experts)
    buffer = make_buffer(group, hidden, world)
    layer = MoELayer(buffer, hidden, num_experts, topk, rank, world)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-2)
    errors = {}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(tokens + 7 * rank, hidden, generator=g).to(torch.bfloat16).cuda().requires_grad_()
        grad_out = torch.randn(x.shape, generator=g).cuda()
        out = layer(x)
        loss = (out.float() * grad_out).sum()
        optimizer.zero_grad()
        loss.backward()
        if check and step == 0:
            errors = _compare(layer, x, out, grad_out, rank, world, group, hidden, num_experts, topk)
        optimizer.step()
        if verbose and rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    buffer.destroy()
    return errors


def _gather(t, world, group):
    """Every rank's tensor (through the CPU: works on gloo and NCCL groups; the checks are small)."""
    parts = [None] * world
    dist.all_gather_object(parts, t.detach().cpu(), group=group)
    return [p.to(t.device) for p in parts]


def _compare(layer, x, out, grad_out, rank, world, group, hidden, num_experts, topk):
    """Output, input gradient, router gradient (summed over ranks) and local expert gradients."""
    xs = _gather(x.detach(), world, group)
    gs = _gather(grad_out, world, group)
    g = torch.Generator().manual_seed(0)
    router = (torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5).cuda().requires_grad_()
    experts = (torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5).cuda().requires_grad_()
    all_x = torch.cat(xs).float().requires_grad_()
    ref = reference(all_x, [p.shape[0] for p in xs], router, experts, topk)
    (ref * torch.cat(gs)).sum().backward()
    first = sum(p.shape[0] for p in xs[:rank])
    mine = slice(first, first + x.shape[0])
    router_grad = sum(_gather(layer.router.grad, world, group))  # each rank's router saw its own tokens only
    L = num_experts // world

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()

    return {"output": rel(out, ref[mine]), "grad_x": rel(x.grad, all_x.grad[mine]),
            "grad_router": rel(router_grad, router.grad),
            "grad_experts": rel(layer.experts.grad, experts.grad[rank * L:(rank + 1) * L])}


TOLERANCE = 3e-2  # relative to the largest magnitude: a few bf16 roundings of partial sums


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = run(rank, world, dist.group.WORLD, steps=args.steps, check=not args.no_check)
    if errors:
        worst = max(errors.values())
        print(f"rank {rank}: relative errors against the single-GPU reference {errors}", flush=True)
        if worst > TOLERANCE:
            raise SystemExit(f"rank {rank}: error {worst:.3g} above {TOLERANCE}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
