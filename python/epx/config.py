"""epx.Config: tuning of the high-throughput kernels, with deep_ep.Config's constructor and size hints.

Every field reaches the library (epx_config): the NVLink fields tune the rings inside one NVLink domain (and the
NVLink sub-rings of the internode mode), the RDMA fields the internode mode's network rings.
"""

from __future__ import annotations

import os
from typing import Optional

from . import _env, _lib


class Config:
    """Kernel tuning: num_sms blocks (num_sms / 2 channels), tokens per send chunk (unused by the senders at 2 ranks
    or fewer; the dispatch's senders publish sooner where a chunk's records pass 180 KiB), ring capacity in tokens;
    internode mode: records per network chunk (num_max_rdma_chunked_send_tokens) and network ring capacity per
    (channel, domain) (num_max_rdma_chunked_recv_tokens, 2 to 64 chunks)."""

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256):
        for name, value in (("num_sms", num_sms),
                            ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config.{name} must be an int, got {type(value).__name__}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_nvl_ranks: Optional[int] = None) -> int:
        """num_nvl_bytes this config needs for rows of hidden_bytes (pass hidden * 2, the BF16 row; that
        also covers FP8 rows of the same hidden with their scales): what the rings inside one NVLink domain need
        (min(num_ranks, 8) ranks: a ring per channel and source rank, at 2 ranks only the peer's, at 1 rank none,
        so 0) or, where the internode mode applies (see get_rdma_buffer_size_hint, which takes num_nvl_ranks
        alike), the larger of that and what its NVLink sub-rings need."""
        num_ranks = _int("num_ranks", num_ranks)
        c = self.to_c()
        intranode = _lib.nvl_size_hint(c, hidden_bytes, min(num_ranks, _lib.limits().max_nvl_ranks))
        G = _domain_size(num_ranks, num_nvl_ranks)
        if G == num_ranks and not _force_internode():
            return intranode
        return max(intranode, _lib.internode_size_hints(c, hidden_bytes, num_ranks, G)[0])

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_nvl_ranks: Optional[int] = None) -> int:
        """num_rdma_bytes the internode mode's network rings need under this config for rows of hidden_bytes; 0 when
        every rank is in one NVLink domain and EPX_FORCE_INTERNODE=1 is not set (the high-throughput path then needs
        no RDMA buffer).

        num_nvl_ranks (epx extension): the NVLink domain size G. By default $EPX_NUM_NVL_RANKS if set, else
        min(num_ranks, 8). A Buffer takes the ranks that share a host as its domain when neither its creation
        nor the environment says otherwise, which this static helper cannot see: on hosts of fewer GPUs than
        min(num_ranks, 8), pass num_nvl_ranks or set EPX_NUM_NVL_RANKS."""
        num_ranks = _int("num_ranks", num_ranks)
        G = _domain_size(num_ranks, num_nvl_ranks)
        if G == num_ranks and not _force_internode():
            return 0
        return _lib.internode_size_hints(self.to_c(), hidden_bytes, num_ranks, G)[1]

    def to_c(self) -> _lib.Config:
        return _lib.Config(self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                           self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens)

    @classmethod
    def from_c(cls, c: _lib.Config) -> "Config":
        return cls(c.num_sms, c.num_max_send_tokens, c.num_max_recv_tokens, c.num_max_rdma_send_tokens,
                   c.num_max_rdma_recv_tokens)

    def __eq__(self, other):
        return isinstance(other, Config) and all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __repr__(self):
        fields = ", ".join(f"{s}={getattr(self, s)}" for s in self.__slots__)
        return f"epx.Config({fields})"


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _domain_size(num_ranks: int, num_nvl_ranks: Optional[int]) -> int:
    """The NVLink domain size G the size hints assume: num_nvl_ranks, else $EPX_NUM_NVL_RANKS, else
    min(num_ranks, 8). The library checks the range and that G divides num_ranks."""
    if num_nvl_ranks is not None:
        return _int("num_nvl_ranks", num_nvl_ranks)
    max_nvl_ranks = _lib.limits().max_nvl_ranks
    env = os.environ.get("EPX_NUM_NVL_RANKS", "")
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if not 1 <= value <= max_nvl_ranks:
            raise ValueError(f"EPX_NUM_NVL_RANKS must be an integer in [1, {max_nvl_ranks}], got '{env}'")
        return value
    return min(num_ranks, max_nvl_ranks)


def _force_internode() -> bool:
    """$EPX_FORCE_INTERNODE as the library reads it: unset, empty or 0 is off, 1 is on."""
    return _env.switch("EPX_FORCE_INTERNODE", False)
