"""The KV cache: one row per token per layer, preallocated, rolled back by moving a length.

For MLA a row is `[c_kv | k_pe]` (kv_lora_rank + qk_rope_head_dim values: 576 for Kimi),
shared by every head; for the MHA draft it is `[K | V]` of every KV head. Rollback after a
rejection is `truncate(n)`: rows past n are never read again (attention only looks at the
first `length` rows) and the next append overwrites them, as in gpt-fast and vLLM.
The engine owns caches and passes them to models, so two sessions never share one.
"""
from __future__ import annotations

import torch


class ContextLengthError(ValueError):
    """A sequence that would not fit in the cache (the model's context)."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        row_width: int,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        name: str = "cache",
    ) -> None:
        self.rows = torch.zeros(num_layers, batch, max_len, row_width, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.name = name

    @property
    def num_layers(self) -> int:
        return self.rows.shape[0]

    @property
    def row_width(self) -> int:
        return self.rows.shape[-1]

    def layer(self, i: int) -> torch.Tensor:
        """[B, max_len, row_width] view of layer i."""
        return self.rows[i]

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ContextLengthError(
                f"{self.name}: {self.length} tokens + {n} new would exceed the context of {self.max_len} tokens"
            )

    def write(self, i: int, start: int, new_rows: torch.Tensor) -> torch.Tensor:
        """Store new rows [B, T, W] of layer i at `start` and return layer i's valid rows."""
        end = start + new_rows.shape[1]
        if end > self.max_len:
            raise ContextLengthError(f"{self.name}: writing up to position {end} exceeds the context of {self.max_len} tokens")
        if torch.compiler.is_compiling():
            # An index write compiles to one graph for any number of new rows. It goes into the
            # whole buffer, not into the view rows[i]: a write through a view of a graph input is
            # functionalised into a copy of the entire cache on every call (O(max_len) per token).
            dev = new_rows.device
            index = (torch.full((1, 1), i, device=dev), torch.arange(new_rows.shape[0], device=dev)[:, None],
                     torch.arange(start, end, device=dev)[None, :])  # layer, batch, position: [B, T]
            self.rows.index_put_(index, new_rows)
        else:
            self.rows[i, :, start:end] = new_rows
        return self.rows[i, :, :end]

    def write_at(self, i: int, position: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Store new rows [B, T, W] of layer i from a position held on the device (a 0-d tensor).

        For a position the host does not know yet (workbench.decoding.fused: the draft's next row
        follows however many proposals the verifier just accepted); nothing is checked on the
        host, so the caller bounds the position. The length is the caller's to set afterwards.
        """
        dev = new_rows.device
        B, T = new_rows.shape[:2]
        index = (torch.full((1, 1), i, device=dev), torch.arange(B, device=dev)[:, None],
                 position + torch.arange(T, device=dev)[None, :])
        self.rows.index_put_(index, new_rows)

    def advance(self, n: int) -> None:
        self.check_room(n)
        self.length += n

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"{self.name}: cannot truncate to {n}; it holds {self.length} tokens")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def valid(self) -> torch.Tensor:
        """[num_layers, B, length, W]: the rows in use (for tests and inspection)."""
        return self.rows[:, :, : self.length]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.rows.shape[1] * self.row_width * self.rows.element_size()

    @property
    def nbytes_allocated(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def nbytes_used(self) -> int:
        return self.length * self.bytes_per_token

    def __repr__(self) -> str:
        return (f"KVCache({self.name}: {self.num_layers} layers x {self.row_width} values/token, "
                f"{self.length}/{self.max_len} tokens, {self.nbytes_allocated / 2**20:.1f} MiB allocated)")
