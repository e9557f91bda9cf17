"""epx.Config: tuning of the high-throughput kernels, with deep_ep.Config's constructor and size hints.

epx's kernels have one ring per (channel, peer) inside an NVLink domain, so only the NVLink fields reach
the library (epx_config); the RDMA fields are kept for signature compatibility and for a future
internode mode.
"""

from __future__ import annotations

from . import _lib

class Config:
    """Kernel tuning: num_sms blocks (num_sms / 2 channels), tokens per send chunk (unused by the senders at 2 ranks
    or fewer), ring capacity in tokens."""

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

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_nvl_bytes this config needs for rows of hidden_bytes (pass hidden * 2, the BF16 row; that
        also covers FP8 rows of the same hidden with their scales)."""
        return _lib.nvl_size_hint(self.to_c(), hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 inside one NVLink domain (up to 8 ranks): the high-throughput path needs no RDMA buffer."""
        max_nvl_ranks = _lib.limits().max_nvl_ranks
        if num_ranks <= max_nvl_ranks:
            return 0
        raise NotImplementedError(f"epx has no internode (RDMA) mode yet: {num_ranks} ranks span several "
                                  f"NVLink domains of at most {max_nvl_ranks} GPUs")

    def to_c(self) -> _lib.Config:
        return _lib.Config(self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens)

    @classmethod
    def from_c(cls, c: _lib.Config) -> "Config":
        return cls(c.num_sms, c.num_max_send_tokens, c.num_max_recv_tokens)

    def __eq__(self, other):
        return isinstance(other, Config) and all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __repr__(self):
        fields = ", ".join(f"{s}={getattr(self, s)}" for s in self.__slots__)
        return f"epx.Config({fields})"
