"""Reference computations in torch on the CPU (docs/semantics.md as Python) and deterministic test data.

Every rank's inputs come from a generator seeded by (seed, rank), so any rank can rebuild any other rank's
inputs locally: the references need no communication. Floating-point steps are written as separate
elementwise tensor ops (no fused multiply-add, no division by a scalar, which torch may turn into a
multiplication by the reciprocal), so that they round exactly as the kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
GROUP = 128


def generator(seed: int, rank: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + salt)


@dataclass
class RankInputs:
    x: torch.Tensor                 # [T, H] bf16
    topk_idx: torch.Tensor          # [T, K] int64, distinct experts per token, some -1
    topk_weights: torch.Tensor      # [T, K] float32 (0 where -1)


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                empty_prob: float = 0.1, scale: float = 1.0) -> RankInputs:
    g = generator(seed, rank)
    x = (torch.randn(num_tokens, hidden, generator=g) * scale).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    topk_idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    empty = torch.rand(num_tokens, num_topk, generator=g) < empty_prob
    topk_idx = torch.where(empty, torch.full_like(topk_idx, -1), topk_idx)
    weights = torch.rand(num_tokens, num_topk, generator=g) + 0.5
    weights = torch.where(empty, torch.zeros_like(weights), weights)
    return RankInputs(x, topk_idx, weights)


def make_scales(seed: int, rank: int, num_tokens: int, num_scales: int) -> torch.Tensor:
    return torch.rand(num_tokens, num_scales, generator=generator(seed, rank, salt=5)) + 0.1


def as_fp8(x: torch.Tensor) -> torch.Tensor:
    """Arbitrary e4m3 data for dispatch tests (dispatch copies bytes; no NaN patterns)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# ---- semantics.md section 1: layout -------------------------------------------------------------------------------------
def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """-> (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""
    T = topk_idx.shape[0]
    L = num_experts // num_ranks
    valid = topk_idx >= 0
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    per_expert.index_add_(0, topk_idx[valid], torch.ones(int(valid.sum()), dtype=torch.int32))
    in_rank = torch.zeros(T, num_ranks, dtype=torch.bool)
    for k in range(topk_idx.shape[1]):
        col = topk_idx[:, k]
        rows = torch.nonzero(col >= 0).flatten()
        in_rank[rows, col[rows] // L] = True
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


# ---- semantics.md section 2: dispatch -----------------------------------------------------------------------------------
@dataclass
class DispatchRef:
    src: List[tuple]                       # (source rank, token) of each received row, in order
    rank_prefix_matrix: torch.Tensor       # [R, R] int32
    recv_src_idx: torch.Tensor             # [N] int32
    recv_topk_idx: torch.Tensor            # [N, K] int64 local ids or -1
    recv_topk_weights: torch.Tensor        # [N, K] float32
    per_expert: List[int]                  # aligned counts per local expert


def dispatch(all_topk: List[torch.Tensor], all_weights: List[Optional[torch.Tensor]], rank: int,
             num_experts: int, expert_alignment: int = 1) -> DispatchRef:
    R = len(all_topk)
    L = num_experts // R
    in_rank = [layout(t, num_experts, R)[2] for t in all_topk]
    prefix = torch.zeros(R, R, dtype=torch.int32)
    for i in range(R):
        prefix[i] = in_rank[i].sum(0).to(torch.int32) + (prefix[i - 1] if i > 0 else 0)
    src, idx_rows, w_rows = [], [], []
    per_expert = [0] * L
    for s in range(R):
        for t in torch.nonzero(in_rank[s][:, rank]).flatten().tolist():
            src.append((s, t))
            ids = all_topk[s][t]
            local = (ids >= rank * L) & (ids < (rank + 1) * L)
            idx_rows.append(torch.where(local, ids - rank * L, torch.full_like(ids, -1)))
            w = all_weights[s][t] if all_weights[s] is not None else torch.zeros(ids.shape[0])
            w_rows.append(torch.where(local, w, torch.zeros_like(w)))
            for e in ids[local].tolist():
                per_expert[e - rank * L] += 1
    K = all_topk[0].shape[1]
    per_expert = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in per_expert]
    return DispatchRef(src, prefix, torch.tensor([t for _, t in src], dtype=torch.int32),
                       torch.stack(idx_rows) if idx_rows else torch.zeros(0, K, dtype=torch.int64),
                       torch.stack(w_rows) if w_rows else torch.zeros(0, K), per_expert)


def gather_rows(tensors: List[torch.Tensor], src: List[tuple], width: int, dtype) -> torch.Tensor:
    if not src:
        return torch.zeros(0, width, dtype=dtype)
    return torch.stack([tensors[s][t] for s, t in src])


# ---- semantics.md section 6: the internode dispatch handle ----------------------------------------------------------------
def channel_of(num_tokens: int, num_channels: int, token: int) -> int:
    """Channels take contiguous token ranges of ceil(T / C) tokens."""
    return token // ((num_tokens + num_channels - 1) // num_channels)


def internode_handle(in_ranks: List[torch.Tensor], rank: int, num_nvl_ranks: int, num_channels: int) -> List:
    """deep_ep's internode handle elements 1..9 on `rank` (element 0 is its is_token_in_rank), from every rank's
    is_token_in_rank [T_s, R] (domains of num_nvl_ranks consecutive ranks, C channels), int32 tensors:
    [1] rdma_channel_prefix_matrix [D, C]: own tokens in channels <= c that need domain m;
    [2] gbl_channel_prefix_matrix [R, C]: own tokens in channels <= c that go to rank j;
    [3] recv_rdma_channel_prefix_matrix [D, C]: tokens of rank (m, g) in channels <= c that need this domain;
    [4] recv_rdma_rank_prefix_sum [D]: inclusive prefix over m of [3][m][C - 1];
    [5] recv_gbl_channel_prefix_matrix [R, C]: first recv_x row of (source, channel);
    [6] recv_gbl_rank_prefix_sum [R]: rows from sources <= s;
    [7] recv_src_meta [N, 2]: per recv_x row, the source's domain and its token's mask of this domain's ranks;
    [8] send_rdma_head [T, D]: own token's position in its channel's stream to domain m, or -(count so far) - 1;
    [9] send_nvl_head [N_rdma, G]: per network record (sources (m, g), m ascending, tokens ascending), its
        position in its channel's stream to rank (d, j), or -(count so far) - 1."""
    R, G, C = len(in_ranks), num_nvl_ranks, num_channels
    D, d, g = R // G, rank // G, rank % G

    def mask(src: int, t: int, m: int) -> int:
        row = in_ranks[src][t, m * G:(m + 1) * G].tolist()
        return sum(1 << j for j, v in enumerate(row) if v)

    def prefix(src: int, pred) -> List[int]:
        T = in_ranks[src].shape[0]
        counts = [0] * C
        for t in range(T):
            if pred(t):
                counts[channel_of(T, C, t)] += 1
        return torch.tensor(counts).cumsum(0).tolist()

    own = in_ranks[rank]
    T = own.shape[0]
    rdma_prefix = [prefix(rank, lambda t, m=m: mask(rank, t, m) != 0) for m in range(D)]
    gbl_prefix = [prefix(rank, lambda t, j=j: bool(own[t, j])) for j in range(R)]
    recv_rdma_prefix = [prefix(m * G + g, lambda t, m=m: mask(m * G + g, t, d) != 0) for m in range(D)]
    recv_rdma_rank_prefix = torch.tensor([p[-1] for p in recv_rdma_prefix]).cumsum(0).tolist()
    recv_gbl_prefix, recv_gbl_rank_prefix, meta, rows = [], [], [], 0
    for s in range(R):
        per_channel = [0] * C
        for t in range(in_ranks[s].shape[0]):
            if in_ranks[s][t, rank]:
                per_channel[channel_of(in_ranks[s].shape[0], C, t)] += 1
                meta.append([s // G, mask(s, t, d)])
        starts = []
        for n in per_channel:
            starts.append(rows)
            rows += n
        recv_gbl_prefix.append(starts)
        recv_gbl_rank_prefix.append(rows)
    send_rdma_head, nxt = [], [[0] * D for _ in range(C)]
    for t in range(T):
        c = channel_of(T, C, t)
        row = []
        for m in range(D):
            k = nxt[c][m]
            row.append(k if mask(rank, t, m) else -k - 1)
            nxt[c][m] += 1 if mask(rank, t, m) else 0
        send_rdma_head.append(row)
    send_nvl_head = []
    for m in range(D):
        src = m * G + g
        Ts = in_ranks[src].shape[0]
        nxt = [[0] * G for _ in range(C)]
        for t in range(Ts):
            if not mask(src, t, d):
                continue
            c = channel_of(Ts, C, t)
            row = []
            for j in range(G):
                k = nxt[c][j]
                goes = bool(in_ranks[src][t, d * G + j])
                row.append(k if goes else -k - 1)
                nxt[c][j] += 1 if goes else 0
            send_nvl_head.append(row)

    def i32(values, *shape):
        return torch.tensor(values, dtype=torch.int32).reshape(*shape)

    return [i32(rdma_prefix, D, C), i32(gbl_prefix, R, C), i32(recv_rdma_prefix, D, C), i32(recv_rdma_rank_prefix, D),
            i32(recv_gbl_prefix, R, C), i32(recv_gbl_rank_prefix, R), i32(meta, -1, 2), i32(send_rdma_head, T, D),
            i32(send_nvl_head, -1, G)]


# ---- semantics.md section 3: combine --------------------------------------------------------------------------------------
def combine(rows_by_rank: List[Optional[torch.Tensor]], in_rank: torch.Tensor, biases=()) -> torch.Tensor:
    """rows_by_rank[j]: [T, H] bf16, the row rank j sends back for each token (used where in_rank[t, j]).
    -> bf16(sum over j ascending in float32 + biases)."""
    T = in_rank.shape[0]
    H = next(r for r in rows_by_rank if r is not None).shape[1]
    acc = torch.zeros(T, H)
    for j, rows in enumerate(rows_by_rank):
        mask = in_rank[:, j:j + 1]
        acc = torch.where(mask, acc + rows.float(), acc)
    for b in biases:
        acc = acc + b.float()
    return acc.to(torch.bfloat16)


def combine_two_level(rows_by_rank: List[Optional[torch.Tensor]], in_rank: torch.Tensor, num_nvl_ranks: int,
                      biases=()) -> torch.Tensor:
    """semantics.md section 6, the internode mode's default order over domains of num_nvl_ranks ranks. Per domain m:
    P_m = the one row of m's receiving ranks unchanged, or bf16(sum of their rows in ascending rank order in
    float32); then bf16(sum of the P_m in ascending domain order in float32 + biases), rounded once."""
    T, R = in_rank.shape
    G = num_nvl_ranks
    H = next(r for r in rows_by_rank if r is not None).shape[1]
    acc = torch.zeros(T, H)
    for m in range(R // G):
        part = torch.zeros(T, H)
        single = torch.zeros(T, H, dtype=torch.bfloat16)
        for j in range(m * G, (m + 1) * G):
            mask = in_rank[:, j:j + 1]
            part = torch.where(mask, part + rows_by_rank[j].float(), part)
            single = torch.where(mask, rows_by_rank[j], single)
        count = in_rank[:, m * G:(m + 1) * G].sum(1, keepdim=True)
        partial = torch.where(count == 1, single, part.to(torch.bfloat16))
        acc = torch.where(count > 0, acc + partial.float(), acc)
    for b in biases:
        acc = acc + b.float()
    return acc.to(torch.bfloat16)


def combine_weights(weights_by_rank: List[torch.Tensor], in_rank: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros_like(weights_by_rank[0])
    for j, w in enumerate(weights_by_rank):
        acc = torch.where(in_rank[:, j:j + 1], acc + w, acc)
    return acc


def scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
    """The stand-in 'expert': bf16(float(x) * factor), bit-identical on CPU and GPU (factor exact in binary)."""
    return (x.float() * factor).to(torch.bfloat16)


# ---- semantics.md section 4: low-latency dispatch -----------------------------------------------------------------------
def ll_blocks(all_topk: List[torch.Tensor], rank: int, num_experts: int) -> List[List[List[int]]]:
    """blocks[i][s]: tokens of source s that select local expert i of `rank`, in (token, slot) order."""
    R = len(all_topk)
    L = num_experts // R
    blocks = [[[] for _ in range(R)] for _ in range(L)]
    for s, idx in enumerate(all_topk):
        for t, row in enumerate(idx.tolist()):
            for e in row:
                if e >= 0 and e // L == rank:
                    blocks[e % L][s].append(t)
    return blocks


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    bits = scale.view(torch.int32)
    has_mantissa = (bits & 0x7FFFFF) != 0
    rounded = (bits & ~0x7FFFFF) + 0x800000
    return torch.where(has_mantissa, rounded, bits).view(torch.float32)


def quantize(x: torch.Tensor, round_scale: bool):
    """Per-128 group FP8: -> (e4m3 [T, H], scales [T, H/128] float32)."""
    T, H = x.shape
    v = x.float().view(T, H // GROUP, GROUP)
    amax = v.abs().amax(dim=2)
    amax = torch.maximum(amax, torch.full_like(amax, AMAX_FLOOR))
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: a true division
    if round_scale:
        scale = round_up_pow2(scale)
    q = v / scale.unsqueeze(2)
    q = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # saturate, then round to nearest even
    return q.view(T, H), scale


def ue8m0_pack(scale: torch.Tensor) -> torch.Tensor:
    """[T, G] power-of-two float scales -> [T, G/4] int32 of their exponent bytes, group 4q+j in byte j."""
    exp = (scale.view(torch.int32) >> 23) & 0xFF
    T, G = exp.shape
    exp = exp.view(T, G // 4, 4).to(torch.int64)
    packed = exp[..., 0] | (exp[..., 1] << 8) | (exp[..., 2] << 16) | (exp[..., 3] << 24)
    return ((packed + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # the same 32 bits, as int32


# ---- semantics.md section 5: low-latency combine --------------------------------------------------------------------------
def ll_combine(expert_rows, topk_idx: torch.Tensor, topk_weights: torch.Tensor, hidden: int,
               logfmt: bool = False) -> torch.Tensor:
    """expert_rows(e) -> [T, H] bf16: expert e's output for each token of this rank.
    out[t] = bf16(sum over k ascending, topk_idx >= 0, of w * float(row)), multiply then add. logfmt: each row
    is first encoded and decoded (semantics.md section 9, logfmt_round_trip)."""
    T, K = topk_idx.shape
    acc = torch.zeros(T, hidden)
    for k in range(K):
        ids = topk_idx[:, k]
        valid = (ids >= 0).unsqueeze(1)
        rows = torch.zeros(T, hidden, dtype=torch.bfloat16)
        for e in ids[ids >= 0].unique().tolist():
            sel = ids == e
            rows[sel] = expert_rows(e)[sel]
        prod = topk_weights[:, k:k + 1] * (logfmt_round_trip(rows) if logfmt else rows.float())
        acc = torch.where(valid, acc + prod, acc)
    return acc.to(torch.bfloat16)


def ll_combine_rank_reduced(expert_rows, topk_idx: torch.Tensor, topk_weights: torch.Tensor, hidden: int,
                            num_experts: int, num_ranks: int) -> torch.Tensor:
    """The rank-reduced order (semantics.md section 5): for every rank r (experts r*L .. r*L+L-1, L = E / R)
    partial_r = bf16(sum over k ascending with topk_idx[t, k] on r of w * float(row)), multiply then add from 0;
    out[t] = bf16(sum over r ascending, ranks holding any of t's experts, of float(partial_r))."""
    T, K = topk_idx.shape
    L = num_experts // num_ranks
    acc = torch.zeros(T, hidden)
    for r in range(num_ranks):
        partial = torch.zeros(T, hidden)
        hit = torch.zeros(T, 1, dtype=torch.bool)
        for k in range(K):
            ids = topk_idx[:, k]
            here = ((ids >= r * L) & (ids < (r + 1) * L)).unsqueeze(1)
            rows = torch.zeros(T, hidden, dtype=torch.bfloat16)
            for e in ids[here.squeeze(1)].unique().tolist():
                sel = ids == e
                rows[sel] = expert_rows(e)[sel]
            prod = topk_weights[:, k:k + 1] * rows.float()
            partial = torch.where(here, partial + prod, partial)
            hit |= here
        acc = torch.where(hit, acc + partial.to(torch.bfloat16).float(), acc)
    return acc.to(torch.bfloat16)


# ---- semantics.md section 9: LogFMT (docs/logfmt.md), written from the document, not from the C++ -------------------------
LOGFMT_GROUP = 128


def _nearest_float32_bits(x: Fraction) -> int:
    """Bits of the float32 nearest to x in [1, 2) (the lower one on a tie)."""
    scaled = x * (1 << 23)
    low = int(scaled)  # floor: x >= 1
    mantissa = low if scaled - low <= Fraction(1, 2) else low + 1
    return (127 << 23) + mantissa - (1 << 23)


def _logfmt_tables():
    """(level_bits[64]: the float32 nearest to 2^(f/64), mantissa_level[128]: the level nearest to 1 + m/128)."""
    from decimal import Decimal, getcontext
    getcontext().prec = 60
    bits = []
    for f in range(64):
        exact = Fraction(Decimal(2) ** (Decimal(f) / Decimal(64)))  # 60 digits: far finer than a float32 half-ulp
        bits.append(_nearest_float32_bits(exact))
    values = [Fraction(1 << 23 | (b & 0x7FFFFF), 1 << 23) for b in bits] + [Fraction(2)]
    mantissa_level = []
    for m in range(128):
        v = 1 + Fraction(m, 128)
        mantissa_level.append(min(range(65), key=lambda i: (abs(v - values[i]), i)))
    return torch.tensor(bits, dtype=torch.int64), torch.tensor(mantissa_level, dtype=torch.int64)


LOGFMT_LEVEL_BITS, LOGFMT_MANTISSA_LEVEL = _logfmt_tables()


def logfmt_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """[T, H] bf16 (H % 128 == 0) -> [T, H] float32: every row encoded as LogFMT and decoded again."""
    T, H = rows.shape
    bits = rows.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    sign, exponent, mantissa = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
    normal = (exponent != 0) & (exponent != 0xFF)
    level = ((exponent - 127) * 64 + LOGFMT_MANTISSA_LEVEL[mantissa]).clamp(max=128 * 64 - 1)
    level = torch.where(normal, level, torch.full_like(level, -32768))
    group_max = level.view(T, H // LOGFMT_GROUP, LOGFMT_GROUP).amax(dim=2, keepdim=True)
    top = torch.where(group_max == -32768, torch.zeros_like(group_max), group_max).expand(-1, -1, LOGFMT_GROUP)
    top = top.reshape(T, H)
    d = top - level
    lowest_ok = (d <= 509 + 64) & (top - 509 >= -126 * 64)
    code = torch.where(d <= 509, 510 - d, torch.where(lowest_ok, torch.ones_like(d), torch.zeros_like(d)))
    code = torch.where(normal, code, torch.zeros_like(code))
    n = top - 510 + code
    value_bits = (LOGFMT_LEVEL_BITS[n & 63] + ((n >> 6) << 23)) | (sign << 31)
    value_bits = torch.where(code == 0, torch.zeros_like(value_bits), value_bits)  # zero and subnormals: +0
    infinity = (exponent == 0xFF) & (mantissa == 0)
    nan = (exponent == 0xFF) & (mantissa != 0)
    value_bits = torch.where(infinity, 0x7F800000 | (sign << 31), value_bits)
    value_bits = torch.where(nan, torch.full_like(value_bits, 0x7FC00000), value_bits)
    value_bits = torch.where(value_bits >= 1 << 31, value_bits - (1 << 32), value_bits)  # the same 32 bits, as int32
    return value_bits.to(torch.int32).view(torch.float32)


def diff_measure(x: torch.Tensor, y: torch.Tensor) -> float:
    """semantics.md section 9's 1 - 2 * sum(x * y) / sum(x * x + y * y), in float64."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
