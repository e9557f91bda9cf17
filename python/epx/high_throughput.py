"""The high-throughput methods of epx.Buffer (semantics.md sections 1-3 and 6): get_dispatch_layout, dispatch
(with a layout, cached, worst-case), combine, and deep_ep's internode entry points. Inside one NVLink domain they run
the intranode kernels; on a Buffer over several domains (or with EPX_FORCE_INTERNODE=1), the internode ones.

Streams, as in deep_ep: a call waits for previous_event (else for the current stream), runs on the communication
stream, and the current stream waits for it at the end unless async_finish (then an EventOverlap is returned,
holding the tensors the call uses). A synchronous call whose stream flags allow it runs straight on the current
stream instead (_streams.Streams.direct), in the same order.

Cached dispatch and combine keep what they can of a handle between calls (_HandleCache); buffer.py's docstring says
how the hot paths save host time.
"""

from __future__ import annotations

import contextlib
from ctypes import byref
from typing import Optional, Tuple, Union

import torch

from . import _checks, _lib
from ._memory import itemsize
from ._streams import check_stream_flags
from .config import Config
from .errors import NotSupportedError
from .event import EventOverlap

Handle = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# deep_ep's internode handle: (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
# recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum,
# recv_src_meta, send_rdma_head, send_nvl_head)
InternodeHandle = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_INT32 = torch.int32
_INT64 = torch.int64
_BF16 = torch.bfloat16
_FP32 = torch.float32
_Tensor = torch.Tensor
_EPX_BF16 = _lib.EPX_BF16
_REDUCE_DEFAULT = _lib.EPX_REDUCE_DEFAULT
_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing
_ROW_MAJOR = (0, 0)  # epx_dispatch_args' scale strides of row-major scales (and of none)
_SOURCE_META_BYTES = 8  # a row of an internode handle's recv_src_meta: two int32 (source domain, rank mask)
_SIZED_HISTORY = 4  # received rows remembered per token count (Buffer._recv_rows)
_SIZED_TOKEN_COUNTS = 8  # token counts remembered
# combine's reduction argument -> epx_combine_args.reduction
_REDUCTIONS = {"flat": _lib.EPX_REDUCE_FLAT, "two_level": _lib.EPX_REDUCE_TWO_LEVEL}


class _HandleCache:
    """What combine and cached dispatch reuse while they are given the same handle object: its C struct
    (and a pointer to it), the default configs for its channel count, and the argument structs of the last
    shapes each operation saw (their pointer fields are set on every call). The handle is referenced, so
    that its tensors (whose addresses the structs hold) stay alive and its id is not reused. Intranode (6-tuple)
    and internode (10-tuple) handles alike: is_token_in_rank is the handle's element of that name."""

    __slots__ = ("handle", "h", "num_recv", "num_tokens", "is_token_in_rank", "configs", "dispatch_key", "dispatch",
                 "combine_key", "combine", "dispatch_config", "combine_config")

    def __init__(self, handle, h, is_token_in_rank):
        self.handle, self.h = handle, h
        self.num_recv, self.num_tokens = h.num_recv_tokens, h.num_tokens
        self.is_token_in_rank = is_token_in_rank
        self.configs = {}  # kind -> epx_config of the default config with the handle's num_sms
        self.dispatch_config = self.combine_config = None  # configs["dispatch"] / ["combine"] once made
        self.dispatch_key = self.dispatch = self.combine_key = self.combine = None


class HighThroughputMixin:
    """The high-throughput methods of epx.Buffer. They use the state Buffer._init_state sets up (_device,
    group_size, _num_nvl_ranks, _internode, _streams, _protos, the config caches and _last_handle) and Buffer's
    _ptr() and num_sms."""

    # ---- internals shared by the operations ---------------------------------------------------------------------
    def _empty(self, shape, dtype) -> torch.Tensor:
        # new_empty of a prototype, with the sizes as separate ints: about half a microsecond cheaper than
        # torch.empty(shape, dtype=, device=), whose keywords and tuple cost more to parse.
        return self._protos[dtype].new_empty(*shape)

    def _sized_rows(self, T: int) -> Optional[int]:
        """The rows to size a ring dispatch's outputs by before its counts are known: the most the last dispatches
        with a layout and T tokens received, plus 1/16 and 8 rows; None (the counts first) without such a call or with
        EPX_HT_SIZED_DISPATCH=0."""
        rows = self._recv_rows.get(T) if self._sized_dispatch else None
        if not rows:
            return None
        n = max(rows)
        return n + (n >> 4) + 8

    def _note_recv_rows(self, T: int, N: int) -> None:
        rows = self._recv_rows.get(T)
        if rows is None:
            if len(self._recv_rows) >= _SIZED_TOKEN_COUNTS:
                self._recv_rows.pop(next(iter(self._recv_rows)))  # the token count seen first
            rows = self._recv_rows[T] = []
        rows.append(N)
        if len(rows) > _SIZED_HISTORY:
            del rows[0]

    def _dispatch_outputs(self, N: int, H: int, dtype, scales, K: int, topk_idx, topk_weights):
        """recv_x, recv_scales, recv_topk_idx and recv_topk_weights (None where the call has none) of N rows."""
        return (self._empty((N, H), dtype),
                self._empty((N, scales.shape[1]), scales.dtype) if scales is not None else None,
                self._empty((N, K), _INT64) if topk_idx is not None else None,
                self._empty((N, K), _FP32) if topk_weights is not None else None)

    def _finish(self, compute, async_finish: bool, allocate_on_comm_stream: bool, tensors) -> EventOverlap:
        if async_finish:
            return self._streams.end_async(compute, tensors, allocate_on_comm_stream)
        return self._streams.end_sync(compute)

    # ---- layout -------------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Counts where this rank's tokens go (semantics.md section 1), as dispatch needs it. Local (not collective): runs
        on the communication stream (a synchronous call may run on the current stream instead, in the same order:
        see get_comm_stream), with no CPU sync.

        Arguments:
            topk_idx: int64 [T, K] (epx.topk_idx_t), contiguous, on the Buffer's device: the experts each of the T
                tokens selected, K in [1, 32]; -1 means no expert in that slot. Values below -1 or >= num_experts
                are an error the library reports (recorded on the device; at the latest check() raises it).
            num_experts: int E >= 1, the number of experts over all ranks, a multiple of the number of ranks R
                (expert e lives on rank e // (E / R)).
            previous_event: EventOverlap or None (default): the call first waits for it (else for the current
                stream).
            async_finish: bool, default False. False: the results are ready on the current stream when the call
                returns. True: the current stream does not wait; wait on the returned event before using them.
            allocate_on_comm_stream: bool, default False. True: the outputs are allocated on the communication
                stream (needs previous_event and async_finish).

        Returns:
            num_tokens_per_rank: int32 [R], tokens with at least one expert on each rank (a token counts once
                per rank).
            num_tokens_per_rdma_rank: int32 [D], tokens with at least one expert in each NVLink domain, in the
                internode mode; None inside one domain.
            num_tokens_per_expert: int32 [E], tokens that selected each expert.
            is_token_in_rank: bool [T, R], whether each token goes to each rank.
            event: EventOverlap, holding an event only with async_finish.
        """
        R = self.group_size
        D = R // self._num_nvl_ranks
        _checks.tensor("topk_idx", topk_idx, _INT64, (None, None), self._device)
        T, K = topk_idx.shape
        _checks.integer("topk_idx.shape[1] (num_topk)", K, 1, 32)
        num_experts = _checks.integer("num_experts", num_experts, 1)
        if num_experts % R != 0:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the number of ranks ({R})")
        async_finish = _checks.flag("async_finish", async_finish)
        check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)

        ptr = self._ptr()
        streams = self._streams
        # A synchronous call may run straight on the current stream (Streams.direct), as cached dispatch does.
        stream, compute = streams.begin_sync_or_direct(previous_event, async_finish)
        with streams.allocating() if allocate_on_comm_stream else _NO_CONTEXT:
            num_tokens_per_rank = self._empty((R,), _INT32)
            num_tokens_per_rdma_rank = self._empty((D,), _INT32) if D > 1 else None
            num_tokens_per_expert = self._empty((num_experts,), _INT32)
            is_token_in_rank = self._empty((T, R), torch.bool)
        args = _lib.LayoutArgs(topk_idx.data_ptr(), T, K, num_experts)
        outs = _lib.LayoutOutputs(num_tokens_per_rank.data_ptr(), _ptr_or_none(num_tokens_per_rdma_rank),
                                  num_tokens_per_expert.data_ptr(), is_token_in_rank.data_ptr())
        lib = _lib.lib()
        lib.check(lib.epx_get_dispatch_layout(ptr, args, outs, stream))
        if compute is None:
            event = EventOverlap()
        else:
            event = self._finish(compute, async_finish, allocate_on_comm_stream,
                                 (topk_idx, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                  is_token_in_rank))
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event

    # ---- dispatch -----------------------------------------------------------------------------------------------
    def _check_x(self, x):
        """x: bf16 [T, H], or (e4m3 [T, H], scales [T, S] float32/int32 at any strides). -> (data, scales, dtype
        code, (token stride, group stride) of the scales in elements: (0, 0) for row-major or no scales)."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"an FP8 x is a tuple (data, scales), got {len(x)} elements")
            data, scales = x
            _checks.tensor("x[0]", data, torch.float8_e4m3fn, (None, None), self._device, aligned16=True)
            T, H = data.shape
            if H % 16 != 0:
                raise ValueError(f"FP8 x needs hidden % 16 == 0 (rows of 16-byte vectors), got hidden {H}")
            strides = _checks.strided_scales("x[1] (scales)", scales, T, self._device)
            return data, scales, _lib.EPX_FP8_E4M3, strides
        _checks.tensor("x", x, _BF16, (None, None), self._device, aligned16=True)
        if x.shape[1] % 8 != 0:
            raise ValueError(f"bf16 x needs hidden % 8 == 0 (rows of 16-byte vectors), got hidden {x.shape[1]}")
        return x, None, _lib.EPX_BF16, _ROW_MAJOR

    def _check_config(self, config, kind: str, hc: Optional[_HandleCache] = None) -> _lib.Config:
        """The C struct of the given config, or of the default one; with a handle, the default takes the
        handle's num_sms (operations that reuse a dispatch's routing must use its channel count). Structs are
        cached: defaults per handle, or per (kind, num_sms of set_num_sms); given configs by their values (a Config
        is mutable, so never by identity)."""
        if config is None:
            if hc is not None:
                c_config = hc.configs.get(kind)
                if c_config is None:
                    c_config = hc.configs[kind] = self._default_config(kind, 2 * hc.h.num_channels)
                    if kind == "dispatch":
                        hc.dispatch_config = c_config
                    else:
                        hc.combine_config = c_config
                return c_config
            return self._default_config(kind, self.num_sms)
        if not isinstance(config, Config):
            raise TypeError(f"config must be an epx.Config, got {type(config).__name__}")
        if hc is not None:
            _check_num_sms(config, hc.h.num_channels, kind)
        key = (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
               config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
        c_config = self._configs.get(key)
        if c_config is None:
            if len(self._configs) > 64:  # configs made on the fly: keep the cache bounded
                self._configs.clear()
            c_config = self._configs[key] = config.to_c()
        return c_config

    def _default_config(self, kind: str, num_sms: Optional[int]) -> _lib.Config:
        """Default structs are rebuilt only when the rank count or the num_sms asked for changes."""
        key = (kind, num_sms)
        c_config = self._default_configs.get(key)
        if c_config is None:
            config = self.get_dispatch_config(self.group_size) if kind == "dispatch" else \
                self.get_combine_config(self.group_size)
            if num_sms is not None:
                config.num_sms = num_sms
            c_config = self._default_configs[key] = config.to_c()
        return c_config

    def _check_handle(self, handle) -> _HandleCache:
        """The last handle checked is remembered: combine and cached dispatch usually reuse one handle several
        times, and its tensors were checked when it was first given (a handle is a tuple, so they cannot be
        swapped afterwards)."""
        hc = self._last_handle
        if hc is not None and hc.handle is handle:
            return hc
        if self._internode:
            return self._check_internode_handle(handle)
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise TypeError("handle must be the 6-tuple returned by dispatch (rank_prefix_matrix, "
                            "channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, "
                            "send_head)")
        R, d = self.group_size, self._device
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, \
            send_head = handle
        _checks.tensor("handle[0] (rank_prefix_matrix)", rank_prefix_matrix, _INT32, (R, R), d)
        _checks.tensor("handle[1] (channel_prefix_matrix)", channel_prefix_matrix, _INT32, (R, None), d)
        C = channel_prefix_matrix.shape[1]
        _checks.tensor("handle[2] (recv_channel_prefix_matrix)", recv_channel_prefix_matrix, _INT32, (R, C), d)
        _checks.tensor("handle[3] (recv_src_idx)", recv_src_idx, _INT32, (None,), d)
        _checks.tensor("handle[4] (is_token_in_rank)", is_token_in_rank, torch.bool, (None, R), d)
        _checks.tensor("handle[5] (send_head)", send_head, _INT32, (is_token_in_rank.shape[0], R), d)
        hc = self._last_handle = _HandleCache(handle, self._handle_struct(handle), is_token_in_rank)
        return hc

    def _check_internode_handle(self, handle) -> _HandleCache:
        if not isinstance(handle, tuple) or len(handle) != 10:
            raise TypeError("this Buffer runs the internode mode: handle must be the 10-tuple returned by its "
                            "dispatch (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, "
                            "recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, "
                            "recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, "
                            "send_nvl_head)")
        R, G, d = self.group_size, self._num_nvl_ranks, self._device
        D = R // G
        is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, \
            recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, \
            send_rdma_head, send_nvl_head = handle
        _checks.tensor("handle[0] (is_token_in_rank)", is_token_in_rank, torch.bool, (None, R), d)
        _checks.tensor("handle[1] (rdma_channel_prefix_matrix)", rdma_channel_prefix_matrix, _INT32, (D, None), d)
        C = rdma_channel_prefix_matrix.shape[1]
        _checks.tensor("handle[2] (gbl_channel_prefix_matrix)", gbl_channel_prefix_matrix, _INT32, (R, C), d)
        _checks.tensor("handle[3] (recv_rdma_channel_prefix_matrix)", recv_rdma_channel_prefix_matrix, _INT32,
                       (D, C), d)
        _checks.tensor("handle[4] (recv_rdma_rank_prefix_sum)", recv_rdma_rank_prefix_sum, _INT32, (D,), d)
        _checks.tensor("handle[5] (recv_gbl_channel_prefix_matrix)", recv_gbl_channel_prefix_matrix, _INT32, (R, C),
                       d)
        _checks.tensor("handle[6] (recv_gbl_rank_prefix_sum)", recv_gbl_rank_prefix_sum, _INT32, (R,), d)
        _checks.tensor("handle[7] (recv_src_meta)", recv_src_meta, torch.uint8, (None, _SOURCE_META_BYTES), d)
        _checks.tensor("handle[8] (send_rdma_head)", send_rdma_head, _INT32, (is_token_in_rank.shape[0], D), d)
        _checks.tensor("handle[9] (send_nvl_head)", send_nvl_head, _INT32, (None, G), d)
        hc = self._last_handle = _HandleCache(handle, self._internode_handle_struct(handle, G), is_token_in_rank)
        return hc

    @staticmethod
    def _handle_struct(handle: Handle) -> _lib.DispatchHandle:
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, \
            send_head = handle
        return _lib.DispatchHandle(rank_prefix_matrix.shape[0], channel_prefix_matrix.shape[1],
                                   is_token_in_rank.shape[0], recv_src_idx.shape[0], rank_prefix_matrix.data_ptr(),
                                   channel_prefix_matrix.data_ptr(), recv_channel_prefix_matrix.data_ptr(),
                                   recv_src_idx.data_ptr(), is_token_in_rank.data_ptr(), send_head.data_ptr())

    @staticmethod
    def _internode_handle_struct(handle: InternodeHandle, num_nvl_ranks: int) -> _lib.DispatchHandle:
        """The C handle of deep_ep's internode handle. Its counts come from the shapes: recv_src_meta has a row per
        row of recv_x, send_nvl_head one per record the network rings received (num_worst_tokens of each in
        worst-case mode)."""
        is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, \
            recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, \
            send_rdma_head, send_nvl_head = handle
        return _lib.DispatchHandle(
            num_ranks=is_token_in_rank.shape[1], num_channels=rdma_channel_prefix_matrix.shape[1],
            num_tokens=is_token_in_rank.shape[0], num_recv_tokens=recv_src_meta.shape[0],
            channel_prefix_matrix=gbl_channel_prefix_matrix.data_ptr(),
            recv_channel_prefix_matrix=recv_gbl_channel_prefix_matrix.data_ptr(),
            is_token_in_rank=is_token_in_rank.data_ptr(), num_domains=rdma_channel_prefix_matrix.shape[0],
            num_nvl_ranks=num_nvl_ranks, num_rdma_recv_tokens=send_nvl_head.shape[0],
            rdma_channel_prefix_matrix=rdma_channel_prefix_matrix.data_ptr(),
            recv_rdma_channel_prefix_matrix=recv_rdma_channel_prefix_matrix.data_ptr(),
            recv_rdma_rank_prefix_sum=recv_rdma_rank_prefix_sum.data_ptr(),
            recv_gbl_rank_prefix_sum=recv_gbl_rank_prefix_sum.data_ptr(), recv_src_meta=recv_src_meta.data_ptr(),
            send_rdma_head=send_rdma_head.data_ptr(), send_nvl_head=send_nvl_head.data_ptr())

    def dispatch(self, x, handle: Union[Handle, InternodeHandle, None] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, outputs_in_buffer: bool = False):
        """Collective: sends each token to the ranks that hold its experts (semantics.md section 2; section 6 in the
        internode mode). Runs on the communication stream; without handle and num_worst_tokens, the CPU waits for
        the received counts (the outputs' sizes) before it returns. Inside one NVLink domain a call with a layout
        sizes its outputs first (num_worst_tokens rows, or from the second call with T tokens on a guess from the
        last such calls) and queues the count exchange and the data in one launch; the outputs are then the first
        N rows of the guessed ones (python/README.md; EPX_HT_SIZED_DISPATCH=0: two steps).

        Arguments:
            x: the T tokens of this rank (T may be 0 and differ between ranks), on the Buffer's device: a bf16
                tensor [T, H] (H a multiple of 8, 16-byte aligned), or for FP8 a tuple (data, scales): data
                float8_e4m3fn [T, H] (H a multiple of 16), scales [T, S] float32 (S >= 1, usually H / 128: one
                scale per 128 elements) or int32 words (packed UE8M0 exponents), at any strides: row-major, or
                column-major as grouped GEMMs keep them (s.T.contiguous().T), read in place without a copy (no
                zero strides: an expanded view must be made contiguous). Rows and scales are copied as they are,
                never requantized.
            handle: default None. The handle of an earlier dispatch of this Buffer to repeat its routing for new
                data (cached mode: no layout arguments, no CPU sync); x must have that dispatch's T tokens.
                num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                topk_weights, expert_alignment and num_worst_tokens are then not used.
            num_tokens_per_rank: int32 [R] from get_dispatch_layout; needed without handle.
            num_tokens_per_rdma_rank: int32 [D] from get_dispatch_layout, or None (default). Optional in the
                internode mode (the library counts on the device); must be None inside one NVLink domain.
            is_token_in_rank: bool [T, R] from get_dispatch_layout; needed without handle.
            num_tokens_per_expert: int32 [E] from get_dispatch_layout (E a positive multiple of R), or None
                (default). Needed with topk_idx (its length gives the expert count).
            topk_idx: int64 [T, K] or None (default): each token's experts (K in [1, 32], -1 for none), to
                receive them rebased to this rank's local expert ids.
            topk_weights: float32 [T, K] or None (default): the matching weights; needs topk_idx (topk_idx without
                topk_weights is allowed).
            expert_alignment: int >= 1, default 1: each entry of num_recv_tokens_per_expert_list is rounded up to
                a multiple of it.
            num_worst_tokens: int >= 0, default 0. > 0: the worst-case number of rows this rank can receive; the
                outputs get exactly that many rows (rows past the received ones are unspecified, their
                recv_topk_idx -1), the CPU does not wait, and the call can be captured in a CUDA graph.
            config: epx.Config or None (default: get_dispatch_config(R)). A combine or cached dispatch with this
                call's handle must use the same num_sms.
            previous_event: EventOverlap or None (default): the call first waits for it (else for the current
                stream).
            async_finish: bool, default False. False: the results are ready on the current stream when the call
                returns. True: the current stream does not wait; wait on the returned event before using them.
            allocate_on_comm_stream: bool, default False. True: the outputs are allocated on the communication
                stream (needs previous_event and async_finish).
            outputs_in_buffer: bool, default False (an epx addition, keyword only). True: the outputs are views of this
                Buffer's output region (num_recv_bytes): every sender writes each row straight to its place there,
                so no rank copies what it received, and the CPU waits for the counts only once the data is queued.
                They stay valid until the next dispatch of any kind on this Buffer (a combine leaves them): copy
                what must live longer. Every rank must pass the same value; inside one NVLink domain only; the
                region must hold every row (else BufferTooSmallError on every rank). The handle stays independent
                of the region.

        Returns (without handle):
            recv_x: the N received tokens, ordered by source rank, then by token index on the source: a bf16
                tensor [N, H], or (data [N, H] float8_e4m3fn, scales [N, S] of x's scale dtype) for an FP8 x;
                the scales are row-major (contiguous) whatever the strides of x's, as deep_ep returns them.
            recv_topk_idx: int64 [N, K]: the expert ids on this rank rebased to local ids (e - rank * E / R), -1
                for the others; None without topk_idx.
            recv_topk_weights: float32 [N, K]: the weights of those experts, 0 for the others; None without
                topk_weights.
            num_recv_tokens_per_expert_list: list of E / R ints: the received tokens that selected each local
                expert, each rounded up to expert_alignment; empty without num_tokens_per_expert or with
                num_worst_tokens.
            handle: what combine (and a cached dispatch) needs, a tuple of tensors on the Buffer's device, int32
                unless said, with C = config.num_sms / 2 channels. Inside one NVLink domain: (rank_prefix_matrix
                [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C], recv_src_idx [N],
                is_token_in_rank [T, R] bool, send_head [T, R]). In the internode mode, deep_ep's 10-tuple over D
                domains of G ranks: (is_token_in_rank [T, R] bool, rdma_channel_prefix_matrix [D, C],
                gbl_channel_prefix_matrix [R, C], recv_rdma_channel_prefix_matrix [D, C],
                recv_rdma_rank_prefix_sum [D], recv_gbl_channel_prefix_matrix [R, C], recv_gbl_rank_prefix_sum
                [R] (rows of recv_x from source ranks 0..s, inclusive), recv_src_meta [N, 8] uint8 (per row: the
                source domain and the mask of this domain's receiving ranks, two int32), send_rdma_head [T, D],
                send_nvl_head [N_rdma, G] (N_rdma: records this rank's network rings received)).
            event: EventOverlap, holding an event only with async_finish.
        With handle: (recv_x, None, None, None, None, event).
        """
        if handle is not None:
            # The common cached call: bf16 x, the handle of the last call whose checks passed (the same tuple), the
            # default config, no previous_event. x is checked in full here; anything else, or an x the short test
            # does not pass, goes through every check below, which raise the error that says what is wrong.
            hc, d = self._last_handle, self._device
            if hc is not None and hc.handle is handle and config is None and previous_event is None \
                    and allocate_on_comm_stream is False and outputs_in_buffer is False \
                    and (async_finish is False or async_finish is True) \
                    and hc.dispatch_config is not None and isinstance(x, _Tensor) and x.dtype is _BF16 \
                    and x.device == d and x.is_contiguous() and not x.data_ptr() & 15:
                xs = x.shape
                if len(xs) == 2 and not xs[1] & 7 and xs[0] == hc.num_tokens:
                    return self._cached_dispatch(x, None, _EPX_BF16, _ROW_MAJOR, xs[1], hc, hc.dispatch_config, None,
                                                 async_finish, False)
        data, scales, dtype, scale_strides = self._check_x(x)
        async_finish = _checks.flag("async_finish", async_finish)
        if previous_event is not None or allocate_on_comm_stream:
            check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        if _checks.flag("outputs_in_buffer", outputs_in_buffer):
            self._check_in_buffer()
        if handle is not None:
            hc = self._check_handle(handle)
            c_config = self._check_config(config, "dispatch", hc)
            T, H = data.shape
            if hc.num_tokens != T:
                raise ValueError(f"x has {T} tokens but the handle was made for {hc.num_tokens}")
            if outputs_in_buffer:
                return self._cached_dispatch_in_buffer(data, scales, dtype, scale_strides, H, hc, c_config,
                                                       previous_event, async_finish)
            return self._cached_dispatch(data, scales, dtype, scale_strides, H, hc, c_config, previous_event,
                                         async_finish, allocate_on_comm_stream)
        c_config = self._check_config(config, "dispatch")

        R, G, d = self.group_size, self._num_nvl_ranks, self._device
        D = R // G
        internode = self._internode
        T, H = data.shape
        if not internode and num_tokens_per_rdma_rank is not None:
            raise ValueError("num_tokens_per_rdma_rank must be None: this Buffer runs inside one NVLink domain")
        _checks.optional_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, _INT32, (D,), d)
        if num_tokens_per_rank is None or is_token_in_rank is None:
            raise ValueError("dispatch without a handle needs num_tokens_per_rank and is_token_in_rank "
                             "(from get_dispatch_layout)")
        _checks.tensor("num_tokens_per_rank", num_tokens_per_rank, _INT32, (R,), d)
        _checks.tensor("is_token_in_rank", is_token_in_rank, torch.bool, (T, R), d)
        _checks.optional_tensor("num_tokens_per_expert", num_tokens_per_expert, _INT32, (None,), d)
        E = num_tokens_per_expert.shape[0] if num_tokens_per_expert is not None else 0
        if num_tokens_per_expert is not None and (E == 0 or E % R != 0):
            raise ValueError(f"num_tokens_per_expert has {E} experts: must be a positive multiple of {R} ranks")
        K = 0
        if topk_idx is not None:
            _checks.tensor("topk_idx", topk_idx, _INT64, (T, None), d)
            K = topk_idx.shape[1]
            _checks.integer("topk_idx.shape[1] (num_topk)", K, 1, 32)
            if num_tokens_per_expert is None:
                raise ValueError("dispatch with topk_idx needs num_tokens_per_expert (its length is num_experts)")
        if topk_weights is not None and topk_idx is None:
            raise ValueError("topk_weights needs topk_idx")
        _checks.optional_tensor("topk_weights", topk_weights, _FP32, (T, K), d)
        expert_alignment = _checks.integer("expert_alignment", expert_alignment, 1)
        num_worst_tokens = _checks.integer("num_worst_tokens", num_worst_tokens, 0)

        ptr = self._ptr()
        streams = self._streams
        compute = streams.begin(previous_event)
        C = _lib.num_channels(c_config)
        with streams.allocating() if allocate_on_comm_stream else _NO_CONTEXT:
            channel_prefix_matrix = self._empty((R, C), _INT32)
            recv_channel_prefix_matrix = self._empty((R, C), _INT32)
            if internode:
                rdma_channel_prefix_matrix = self._empty((D, C), _INT32)
                recv_rdma_channel_prefix_matrix = self._empty((D, C), _INT32)
                recv_rdma_rank_prefix_sum = self._empty((D,), _INT32)
                recv_gbl_rank_prefix_sum = self._empty((R,), _INT32)
                send_rdma_head = self._empty((T, D), _INT32)
            else:
                rank_prefix_matrix = self._empty((R, R), _INT32)
                send_head = self._empty((T, R), _INT32)
        args = _lib.DispatchArgs(
            data.data_ptr(), dtype, T, H, _ptr_or_none(scales), scales.shape[1] if scales is not None else 0,
            scale_strides[0], scale_strides[1], _ptr_or_none(topk_idx), _ptr_or_none(topk_weights), K, E, num_tokens_per_rank.data_ptr(),
            num_tokens_per_expert.data_ptr() if E else None, is_token_in_rank.data_ptr(), expert_alignment,
            num_worst_tokens)
        if internode:
            h = _lib.DispatchHandle(
                channel_prefix_matrix=channel_prefix_matrix.data_ptr(),
                recv_channel_prefix_matrix=recv_channel_prefix_matrix.data_ptr(),
                rdma_channel_prefix_matrix=rdma_channel_prefix_matrix.data_ptr(),
                recv_rdma_channel_prefix_matrix=recv_rdma_channel_prefix_matrix.data_ptr(),
                recv_rdma_rank_prefix_sum=recv_rdma_rank_prefix_sum.data_ptr(),
                recv_gbl_rank_prefix_sum=recv_gbl_rank_prefix_sum.data_ptr(), send_rdma_head=send_rdma_head.data_ptr())
        else:
            h = _lib.DispatchHandle(0, 0, 0, 0, rank_prefix_matrix.data_ptr(), channel_prefix_matrix.data_ptr(),
                                    recv_channel_prefix_matrix.data_ptr(), None, None, send_head.data_ptr())
        counts = _lib.DispatchCounts()
        lib, stream = _lib.lib(), streams.comm_raw
        if outputs_in_buffer:
            region = _lib.RecvRegion()
            lib.check(lib.epx_dispatch_in_buffer(ptr, byref(args), byref(c_config), byref(h), 0, byref(counts),
                                                 byref(region), stream))
            per_expert = counts.num_recv_tokens_per_expert[:counts.num_local_experts]
            N = num_worst_tokens if num_worst_tokens > 0 else counts.num_recv_tokens
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = self._region_views(
                region, N, H, data.dtype, scales, K if topk_idx is not None else 0, topk_weights is not None)
            # The handle owns its recv_src_idx (the region's is overwritten by the next dispatch).
            with streams.allocating() if allocate_on_comm_stream else _NO_CONTEXT:
                recv_src_idx = self._empty((N,), _INT32)
            with torch.cuda.stream(streams.comm):
                recv_src_idx.copy_(self._views.tensor(region.recv_src_idx, N * 4, _INT32, (N,), d, self))
        else:
            # Inside one domain, outputs sized first (num_worst_tokens rows, or a guess), then the count exchange and
            # the data kernel at once (in one grid where the device has an SM to spare).
            sized = None
            sizable = not internode
            guess = (num_worst_tokens if num_worst_tokens > 0 else self._sized_rows(T)) if sizable else None
            if guess is not None:
                with streams.allocating() if allocate_on_comm_stream else _NO_CONTEXT:
                    sized = self._dispatch_outputs(guess, H, data.dtype, scales, K, topk_idx, topk_weights)
                    recv_src_idx = self._empty((guess,), _INT32)
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights = sized
                h.recv_src_idx = recv_src_idx.data_ptr()
                outs = _lib.DispatchOutputs(recv_x.data_ptr(), _ptr_or_none(recv_scales),
                                            _ptr_or_none(recv_topk_idx), _ptr_or_none(recv_topk_weights), guess)
                lib.check(lib.epx_dispatch_sized(ptr, byref(args), byref(c_config), byref(h), byref(outs),
                                                 byref(counts), stream))
                if num_worst_tokens == 0 and counts.num_recv_tokens < 0:
                    sized = None  # a rank's rows did not fit: every rank repeats the dispatch below
            if sized is not None and num_worst_tokens > 0:
                per_expert, N = [], num_worst_tokens
            elif sized is not None:
                per_expert = counts.num_recv_tokens_per_expert[:counts.num_local_experts]
                N = counts.num_recv_tokens
                recv_x, recv_src_idx = recv_x[:N], recv_src_idx[:N]
                if recv_scales is not None:
                    recv_scales = recv_scales[:N]
                if recv_topk_idx is not None:
                    recv_topk_idx = recv_topk_idx[:N]
                if recv_topk_weights is not None:
                    recv_topk_weights = recv_topk_weights[:N]
            else:
                lib.check(lib.epx_notify_dispatch(ptr, byref(args), byref(c_config), byref(h), byref(counts), stream))
                # The counts live in library memory that the next call reuses: copy them now.
                per_expert = counts.num_recv_tokens_per_expert[:counts.num_local_experts]
                N = num_worst_tokens if num_worst_tokens > 0 else counts.num_recv_tokens
            if sizable and num_worst_tokens == 0:
                self._note_recv_rows(T, N)
        if not outputs_in_buffer and sized is None:
            N_rdma = num_worst_tokens if num_worst_tokens > 0 else counts.num_rdma_recv_tokens  # internode
            with streams.allocating() if allocate_on_comm_stream else _NO_CONTEXT:
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights = self._dispatch_outputs(
                    N, H, data.dtype, scales, K, topk_idx, topk_weights)
                if internode:
                    recv_src_meta = self._empty((N, 2), _INT32)
                    send_nvl_head = self._empty((N_rdma, G), _INT32)
                else:
                    recv_src_idx = self._empty((N,), _INT32)
            if internode:
                h.recv_src_meta = recv_src_meta.data_ptr()
                h.send_nvl_head = send_nvl_head.data_ptr()
            else:
                h.recv_src_idx = recv_src_idx.data_ptr()
            outs = _lib.DispatchOutputs(recv_x.data_ptr(), _ptr_or_none(recv_scales), _ptr_or_none(recv_topk_idx),
                                        _ptr_or_none(recv_topk_weights), N)
            lib.check(lib.epx_dispatch(ptr, byref(args), byref(c_config), byref(h), byref(outs), stream))

        if internode:
            handle = (is_token_in_rank, rdma_channel_prefix_matrix, channel_prefix_matrix,
                      recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_channel_prefix_matrix,
                      recv_gbl_rank_prefix_sum, recv_src_meta.view(torch.uint8), send_rdma_head, send_nvl_head)
        else:
            handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                      is_token_in_rank, send_head)
        event = self._finish(compute, async_finish, allocate_on_comm_stream,
                             (data, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert,
                              recv_x, recv_scales, recv_topk_idx, recv_topk_weights) + handle)
        recv = (recv_x, recv_scales) if scales is not None else recv_x
        return recv, recv_topk_idx, recv_topk_weights, per_expert, handle, event

    def _cached_dispatch(self, data, scales, dtype, scale_strides, H: int, hc: _HandleCache, c_config: _lib.Config,
                         previous_event, async_finish, allocate_on_comm_stream):
        """The cached dispatch after its checks (data has the handle's token count)."""
        N = hc.num_recv
        S = scales.shape[1] if scales is not None else 0

        native = self._native
        ptr = native.ptr if native is not None else None
        if ptr is None:
            ptr = self._ptr()  # raises
        key = (H, dtype, S, scale_strides)
        if hc.dispatch_key != key:
            args = _lib.DispatchArgs(None, dtype, hc.num_tokens, H, None, S, scale_strides[0], scale_strides[1], None,
                                     None, 0, 0, None, None, hc.is_token_in_rank.data_ptr(), 1, 0)
            outs = _lib.DispatchOutputs(None, None, None, None, N)
            hc.dispatch, hc.dispatch_key = (args, outs), key
        args, outs = hc.dispatch
        streams = self._streams
        stream, compute = streams.begin_sync_or_direct(previous_event, async_finish)
        protos = self._protos
        if allocate_on_comm_stream:
            with streams.allocating():
                recv_x = protos[data.dtype].new_empty(N, H)
                recv_scales = protos[scales.dtype].new_empty(N, S) if scales is not None else None
        else:
            recv_x = protos[data.dtype].new_empty(N, H)
            recv_scales = protos[scales.dtype].new_empty(N, S) if scales is not None else None
        args.x = data.data_ptr()
        outs.recv_x = recv_x.data_ptr()
        if scales is not None:
            args.x_scales = scales.data_ptr()
            outs.recv_x_scales = recv_scales.data_ptr()
        lib = _lib.lib()
        # The structs themselves, not byref(): ctypes converts them to pointers faster (POINTER argtypes).
        status = lib.epx_dispatch_cached(ptr, args, c_config, hc.h, outs, stream)
        if status:
            lib.check(status)
        if async_finish:
            event = streams.end_async(compute, (data, scales, recv_x, recv_scales) + hc.handle,
                                      allocate_on_comm_stream)
        else:
            event = streams.end_sync(compute) if compute is not None else EventOverlap()
        if scales is not None:
            return (recv_x, recv_scales), None, None, None, None, event
        return recv_x, None, None, None, None, event

    def _check_in_buffer(self, what: str = "dispatch(..., outputs_in_buffer=True)") -> None:
        if self._internode:
            raise NotSupportedError(f"{what} runs inside one NVLink domain; this Buffer spans several (or its "
                                    "internode mode was forced)")
        if not self.num_recv_bytes:
            raise ValueError(f"{what} needs an output region: create the Buffer with num_recv_bytes "
                             "(Buffer.get_recv_region_size_hint)")

    def _combine_region(self, hidden: int, num_topk: int) -> _lib.RecvRegion:
        region = _lib.RecvRegion()
        lib = _lib.lib()
        lib.check(lib.epx_combine_region(self._ptr(), hidden, num_topk, byref(region)))
        return region

    def get_combine_input_buffer(self, handle, hidden: int, num_topk: int = 0):
        """Returns where combine(..., inputs_in_buffer=True) reads this rank's rows: (x, topk_weights), views of the
        output region (num_recv_bytes): x bf16 [N, hidden] and topk_weights float32 [N, num_topk] (None for
        num_topk 0), N the rows of the dispatch whose handle is given. Write the expert outputs (and weights) there,
        then combine. After a BF16 dispatch with outputs_in_buffer of the same hidden and top-k they are its recv_x
        and recv_topk_weights; after an FP8 one they overlap its outputs (write them once those are read). Valid
        until the next dispatch on this Buffer. An epx addition, inside one NVLink domain.

        Arguments:
            handle: the handle of the dispatch whose rows the combine sums.
            hidden: int, the combine's row length (a multiple of 8).
            num_topk: int in [0, 32], default 0: K of the weights the combine sums (0: none).
        """
        self._check_in_buffer("get_combine_input_buffer")
        hc = self._check_handle(handle)
        hidden = _checks.integer("hidden", hidden, 1)
        num_topk = _checks.integer("num_topk", num_topk, 0, 32)
        region = self._combine_region(hidden, num_topk)
        N, v, d = hc.num_recv, self._views, self._device
        if N > region.capacity:
            raise ValueError(f"the handle's {N} rows exceed the {region.capacity} the output region holds of rows of "
                             f"hidden {hidden}")
        x = v.tensor(region.recv_x, N * hidden * 2, _BF16, (N, hidden), d, self)
        w = v.tensor(region.recv_topk_weights, N * num_topk * 4, _FP32, (N, num_topk), d, self) if num_topk else None
        return x, w

    def _region_views(self, region, N: int, H: int, data_dtype, scales, K: int, with_weights: bool):
        """recv_x, recv_scales, recv_topk_idx and recv_topk_weights of N rows as views of the output region."""
        v, d = self._views, self._device
        recv_x = v.tensor(region.recv_x, N * H * itemsize(data_dtype), data_dtype, (N, H), d, self)
        recv_scales = None
        if scales is not None:
            S = scales.shape[1]
            recv_scales = v.tensor(region.recv_x_scales, N * S * 4, scales.dtype, (N, S), d, self)
        recv_topk_idx = v.tensor(region.recv_topk_idx, N * K * 8, _INT64, (N, K), d, self) if K else None
        recv_topk_weights = None
        if K and with_weights:
            recv_topk_weights = v.tensor(region.recv_topk_weights, N * K * 4, _FP32, (N, K), d, self)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights

    def _cached_dispatch_in_buffer(self, data, scales, dtype, scale_strides, H: int, hc: _HandleCache,
                                   c_config: _lib.Config, previous_event, async_finish):
        """The cached dispatch into the output region, after its checks."""
        N = hc.num_recv
        S = scales.shape[1] if scales is not None else 0
        args = _lib.DispatchArgs(data.data_ptr(), dtype, hc.num_tokens, H, _ptr_or_none(scales), S, scale_strides[0],
                                 scale_strides[1], None, None, 0, 0, None, None, hc.is_token_in_rank.data_ptr(), 1, 0)
        ptr = self._ptr()
        streams = self._streams
        compute = streams.begin(previous_event)
        region = _lib.RecvRegion()
        h = _lib.DispatchHandle.from_buffer_copy(hc.h)  # the call may not change the cached handle struct
        lib = _lib.lib()
        lib.check(lib.epx_dispatch_in_buffer(ptr, byref(args), byref(c_config), byref(h), 1, None, byref(region),
                                             streams.comm_raw))
        recv_x, recv_scales, _, _ = self._region_views(region, N, H, data.dtype, scales, 0, False)
        event = self._finish(compute, async_finish, False, (data, scales, recv_x, recv_scales) + hc.handle)
        if scales is not None:
            return (recv_x, recv_scales), None, None, None, None, event
        return recv_x, None, None, None, None, event

    # ---- combine ------------------------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: Union[Handle, InternodeHandle],
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None, config: Optional[Config] = None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                reduction: Optional[str] = None, inputs_in_buffer: bool = False):
        """Collective: sums each token's rows from the ranks it was dispatched to, back on its source rank
        (semantics.md section 3; section 6 in the internode mode): float32 over the receiving ranks in ascending
        order, plus the biases, rounded once to bf16. Deterministic (the same bits on every run). Runs on the communication
        stream (a synchronous call may run straight on the current stream, with the same result), with no CPU sync.

        Arguments:
            x: bf16 [N, H] (H a multiple of 8, 16-byte aligned), on the Buffer's device: one row per row of the
                dispatch's recv_x (typically the experts' outputs, already weighted: the sum has no weights).
            handle: the handle returned by the dispatch whose rows x holds (a 6-tuple inside one NVLink domain,
                deep_ep's 10-tuple in the internode mode).
            topk_weights: float32 [N, K] or None (default): per-row weights to sum back the same way (e.g. the
                dispatch's recv_topk_weights).
            bias: None (default), a bf16 [T, H] tensor, or a tuple of up to two: added to every combined row.
            config: epx.Config or None (default: get_combine_config(R) with the dispatch's num_sms, which a given
                config must also have).
            previous_event: EventOverlap or None (default): the call first waits for it (else for the current
                stream).
            async_finish: bool, default False. False: the results are ready on the current stream when the call
                returns. True: the current stream does not wait; wait on the returned event before using them.
            allocate_on_comm_stream: bool, default False. True: the outputs are allocated on the communication
                stream (needs previous_event and async_finish).
            inputs_in_buffer: bool, default False (an epx addition, keyword only). True: x (and topk_weights, if
                given) are the views get_combine_input_buffer returns (for a BF16 dispatch with outputs_in_buffer
                also its recv_x and recv_topk_weights, with the expert outputs written over recv_x in place), and
                the source rank reads every rank's rows there through NVLink: no ring, no sending warps. The same
                bits as without it. Every rank must pass the same value; inside one NVLink domain only.
            reduction: keyword-only epx extension (semantics.md section 6): the summation order of an internode Buffer.
                None (default) or "two_level" there: per NVLink domain, the rows of that domain's receiving ranks
                summed in float32 in ascending rank order and rounded to bf16 (a single row passes unchanged),
                then those partials summed in ascending domain order in float32 with the biases, rounded once.
                "flat": the single-domain order over every rank (bit-identical to a one-domain run). Inside one
                NVLink domain the order is always flat: None and "flat" are accepted, "two_level" is a
                ValueError.

        Returns:
            combined_x: bf16 [T, H], T the dispatch's token count on this rank.
            combined_topk_weights: float32 [T, K], the summed topk_weights (summed flat in either order); None
                without topk_weights.
            event: EventOverlap, holding an event only with async_finish.
        """
        d = self._device
        hc = self._last_handle
        # The common call: the handle of the last call whose checks passed (the same tuple), the default config, no
        # biases, no previous_event. Every tensor check is repeated, in the same order; anything else, or a tensor
        # the short test here does not pass, goes through every check (_combine_checks), which raises the error
        # that says what is wrong.
        H = -1
        if hc is not None and hc.handle is handle and reduction is None and bias is None and config is None \
                and previous_event is None and allocate_on_comm_stream is False and inputs_in_buffer is False \
                and (async_finish is False or async_finish is True) and hc.combine_config is not None \
                and isinstance(x, _Tensor) and x.dtype is _BF16 and x.device == d and x.is_contiguous() \
                and not x.data_ptr() & 15:
            xs, N = x.shape, hc.num_recv
            if len(xs) == 2 and xs[0] == N and not xs[1] & 7:
                if topk_weights is None:
                    H, K = xs[1], 0
                elif isinstance(topk_weights, _Tensor) and topk_weights.dtype is _FP32 and topk_weights.device == d \
                        and topk_weights.is_contiguous():
                    ws = topk_weights.shape
                    if len(ws) == 2 and ws[0] == N and 1 <= ws[1] <= 32:
                        H, K = xs[1], ws[1]
            code, bias0, bias1, c_config = _REDUCE_DEFAULT, None, None, hc.combine_config
        if H < 0:
            hc, H, K, code, bias0, bias1, c_config, async_finish = self._combine_checks(
                x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream,
                reduction)
            if _checks.flag("inputs_in_buffer", inputs_in_buffer):
                self._check_in_buffer("combine(..., inputs_in_buffer=True)")
                region = self._combine_region(H, K)
                if x.data_ptr() != region.recv_x or (K and topk_weights.data_ptr() != region.recv_topk_weights):
                    raise ValueError("combine(..., inputs_in_buffer=True): x and topk_weights must be the views "
                                     "get_combine_input_buffer(handle, hidden, num_topk) returns")

        native = self._native
        ptr = native.ptr if native is not None else None
        if ptr is None:
            ptr = self._ptr()  # raises
        N, T = hc.num_recv, hc.num_tokens
        key = (H, K, code)
        if hc.combine_key != key:
            args = _lib.CombineArgs(None, N, H, None, K, None, None, code)
            outs = _lib.CombineOutputs()
            hc.combine, hc.combine_key = (args, outs), key
        args, outs = hc.combine
        streams = self._streams
        stream, compute = streams.begin_sync_or_direct(previous_event, async_finish)
        protos = self._protos
        if allocate_on_comm_stream:
            with streams.allocating():
                combined_x = protos[_BF16].new_empty(T, H)
                combined_weights = protos[_FP32].new_empty(T, K) if K else None
        else:
            combined_x = protos[_BF16].new_empty(T, H)
            combined_weights = protos[_FP32].new_empty(T, K) if K else None
        args.x = x.data_ptr()
        args.topk_weights = topk_weights.data_ptr() if K else None
        args.bias0 = bias0.data_ptr() if bias0 is not None else None
        args.bias1 = bias1.data_ptr() if bias1 is not None else None
        outs.combined_x = combined_x.data_ptr()
        outs.combined_topk_weights = combined_weights.data_ptr() if K else None
        lib = _lib.lib()
        if inputs_in_buffer is False:
            status = lib.epx_combine(ptr, args, c_config, hc.h, outs, stream)
        else:
            status = lib.epx_combine_in_buffer(ptr, args, c_config, hc.h, outs, stream)
        if status:
            lib.check(status)
        if async_finish:
            event = streams.end_async(compute, (x, topk_weights, bias0, bias1, combined_x, combined_weights)
                                      + hc.handle, allocate_on_comm_stream)
        else:
            event = streams.end_sync(compute) if compute is not None else EventOverlap()
        return combined_x, combined_weights, event

    def _combine_checks(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                        allocate_on_comm_stream, reduction):
        """Every check of combine, in order. -> (handle cache, H, K, reduction code, bias0, bias1, config struct,
        async_finish)."""
        d = self._device
        code = _REDUCE_DEFAULT if reduction is None else self._reduction_code(reduction)
        hc = self._check_handle(handle)
        N, T = hc.num_recv, hc.num_tokens
        _checks.tensor("x", x, _BF16, (N, None), d, aligned16=True)
        H = x.shape[1]
        if H % 8 != 0:
            raise ValueError(f"combine needs hidden % 8 == 0 (bf16 rows of 16-byte vectors), got {H}")
        K = 0
        if topk_weights is not None:
            _checks.tensor("topk_weights", topk_weights, _FP32, (N, None), d)
            K = _checks.integer("topk_weights.shape[1] (num_topk)", topk_weights.shape[1], 1, 32)
        bias0, bias1 = _check_biases(bias, T, H, d) if bias is not None else (None, None)
        c_config = self._check_config(config, "combine", hc)
        async_finish = _checks.flag("async_finish", async_finish)
        if previous_event is not None or allocate_on_comm_stream:
            check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        return hc, H, K, code, bias0, bias1, c_config, async_finish

    # ---- deep_ep's internode entry points -------------------------------------------------------------------------
    def internode_dispatch(self, x, handle: Optional[InternodeHandle] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
                           *, outputs_in_buffer: bool = False):
        """Collective: dispatch on a Buffer that runs the internode mode (deep_ep's entry point, which its
        dispatch calls over several domains; call dispatch instead, which picks the mode).

        Arguments and returns: those of dispatch, in the same order and with the same defaults (config may be
        None here too); the handle is deep_ep's internode 10-tuple.

        Raises epx.NotSupportedError on a Buffer that runs inside one NVLink domain (is_internode_available()
        is False).
        """
        self._require_internode("internode_dispatch", "dispatch")
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                             previous_event, async_finish, allocate_on_comm_stream,
                             outputs_in_buffer=outputs_in_buffer)

    def internode_combine(self, x: torch.Tensor, handle: InternodeHandle, topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None,
                          config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False, *, reduction: Optional[str] = None,
                          inputs_in_buffer: bool = False):
        """Collective: combine on a Buffer that runs the internode mode (deep_ep's entry point, which its
        combine calls over several domains; call combine instead).

        Arguments and returns: those of combine, in the same order and with the same defaults, reduction
        included; handle is the internode 10-tuple of the dispatch.

        Raises epx.NotSupportedError on a Buffer that runs inside one NVLink domain (is_internode_available()
        is False).
        """
        self._require_internode("internode_combine", "combine")
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream, reduction=reduction, inputs_in_buffer=inputs_in_buffer)

    def _require_internode(self, name: str, instead: str) -> None:
        if not self._internode:
            raise NotSupportedError(f"{name}: this Buffer runs inside one NVLink domain (the intranode kernels); "
                                    f"call {instead}, which runs the Buffer's mode", 6)

    def _reduction_code(self, reduction) -> int:
        """combine's reduction (not None) -> epx_combine_args.reduction."""
        code = _REDUCTIONS.get(reduction) if isinstance(reduction, str) else None
        if code is None:
            if not isinstance(reduction, str):
                raise TypeError(f"reduction must be a str or None, got {type(reduction).__name__}")
            raise ValueError(f"reduction must be 'two_level', 'flat' or None, got {reduction!r}")
        if code == _lib.EPX_REDUCE_TWO_LEVEL and not self._internode:
            raise ValueError("reduction='two_level' is the internode mode's order: inside one NVLink domain combine "
                             "sums in the flat order (pass 'flat' or None)")
        return code


def _ptr_or_none(t: Optional[torch.Tensor]):
    return t.data_ptr() if t is not None else None


def _check_num_sms(config: Config, channels: int, op: str) -> None:
    if config.num_sms != 2 * channels:
        raise ValueError(f"{op}: config.num_sms ({config.num_sms}) must be the dispatch's ({2 * channels}: the "
                         f"handle has {channels} channels)")


def _check_biases(bias, T: int, H: int, device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None:
        return None, None
    items = (bias,) if isinstance(bias, torch.Tensor) else bias
    if not isinstance(items, (tuple, list)) or len(items) > 2:
        raise TypeError("bias must be a tensor or a tuple of at most 2 tensors")
    out = [None, None]
    for i, b in enumerate(items):
        out[i] = _checks.optional_tensor(f"bias[{i}]", b, torch.bfloat16, (T, H), device, aligned16=True)
    return out[0], out[1]
