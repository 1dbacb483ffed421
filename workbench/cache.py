"""The KV cache: one row per token per layer, preallocated, rolled back by moving a length.

For MLA a row is `[c_kv | k_pe]` (kv_lora_rank + qk_rope_head_dim values: 576 for Kimi),
shared by every head; for the MHA draft it is `[K | V]` of every KV head. Rollback after a
rejection is `truncate(n)`: rows past n are never read again (attention only looks at the
first `length` rows) and the next append overwrites them, as in gpt-fast and vLLM.

A cache holds `batch` sequences, each with its own length: `lengths`, always one per sequence,
whatever they hold. A forward appends the same number of rows to every sequence, each at its
own length (`positions`, `write`), then each is truncated to what it accepted. `view` is a
cache over some of the sequences that shares the rows and the lengths (the batched engine
prefills one request into its slot through a view of one); `length` is a one-sequence cache's
length, a convenience for a batch of one. The engine owns caches and passes them to models, so
two sessions never share one.
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
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"{name}: batch = {batch!r}; expected an integer >= 1")
        self.rows = torch.zeros(num_layers, batch, max_len, row_width, dtype=dtype, device=device)
        self.max_len = max_len
        self.name = name
        self._lens = [0] * batch  # every sequence's length; a view shares this list
        self._at, self._batch = 0, batch  # this cache's sequences in `_lens` (plain ints: traced graphs read them)

    def view(self, first: int, count: int = 1) -> "KVCache":
        """A cache over sequences first..first+count-1 that shares this one's rows and lengths."""
        if not (0 <= first and count >= 1 and first + count <= self.batch):
            raise ValueError(f"{self.name}: view of sequences {first}..{first + count - 1}; it holds {self.batch}")
        new = object.__new__(KVCache)
        new.rows, new.max_len, new.name = self.rows[:, first:first + count], self.max_len, self.name
        new._lens, new._at, new._batch = self._lens, self._at + first, count
        return new

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def num_layers(self) -> int:
        return self.rows.shape[0]

    @property
    def row_width(self) -> int:
        return self.rows.shape[-1]

    @property
    def lengths(self) -> list[int]:
        """Each sequence's length (a copy)."""
        return self._lens[self._at:self._at + self.batch]

    @property
    def length(self) -> int:
        """A one-sequence cache's length; an error for more sequences (read `lengths`)."""
        if self.batch != 1:
            raise ValueError(f"{self.name}: `length` of a cache of {self.batch} sequences; read `lengths`, one each")
        return self._lens[self._at]

    @length.setter
    def length(self, n: int) -> None:
        self.set_lengths([n] * self.batch)

    def positions(self, num_new: int, device: torch.device | str) -> torch.Tensor:
        """[B, T]: the absolute positions of num_new tokens appended to each sequence, at its own length."""
        return torch.tensor(self.lengths, device=device)[:, None] + torch.arange(num_new, device=device)

    def set_lengths(self, lengths: list[int]) -> None:
        if len(lengths) != self.batch or any(not 0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"{self.name}: lengths {lengths}; expected {self.batch} values in [0, {self.max_len}]")
        self._lens[self._at:self._at + self.batch] = lengths

    def layer(self, i: int) -> torch.Tensor:
        """[B, max_len, row_width] view of layer i."""
        return self.rows[i]

    def check_room(self, n: int) -> None:
        longest = max(self.lengths)
        if longest + n > self.max_len:
            raise ContextLengthError(
                f"{self.name}: {longest} tokens + {n} new would exceed the context of {self.max_len} tokens"
            )

    def write(self, i: int, new_rows: torch.Tensor) -> torch.Tensor:
        """Store new rows [B, T, W] of layer i, each sequence's at its own length, and return layer i's
        rows up to the end of the longest write (the lengths are the model's to advance)."""
        T, lens = new_rows.shape[1], self.lengths
        end = max(lens) + T
        if end > self.max_len:
            raise ContextLengthError(f"{self.name}: writing up to position {end} exceeds the context of {self.max_len} tokens")
        if torch.compiler.is_compiling():
            # An index write compiles to one graph for any number of new rows. It goes into the
            # whole buffer, not into the view rows[i]: a write through a view of a graph input is
            # functionalised into a copy of the entire cache on every call (O(max_len) per token).
            dev = new_rows.device
            index = (torch.full((1, 1), i, device=dev), torch.arange(self.batch, device=dev)[:, None],
                     self.positions(T, dev))  # layer, sequence, position: [B, T]
            self.rows.index_put_(index, new_rows)
        else:
            for b, s in enumerate(lens):  # B small copies: each sequence's rows land at its own length
                self.rows[i, b, s:s + T] = new_rows[b]
        return self.rows[i, :, :end]

    def write_at(self, i: int, position: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Store new rows [B, T, W] of layer i from a position held on the device (0-d: every
        sequence's, or [B]: each its own).

        For a position the host does not know yet (workbench.decoding.fused: the draft's next row
        follows however many proposals the verifier just accepted); nothing is checked on the
        host, so the caller bounds the position. The length is the caller's to set afterwards.
        """
        dev = new_rows.device
        B, T = new_rows.shape[:2]
        index = (torch.full((1, 1), i, device=dev), torch.arange(B, device=dev)[:, None],
                 position.reshape(-1, 1) + torch.arange(T, device=dev)[None, :])
        self.rows.index_put_(index, new_rows)

    def advance(self, n: int) -> None:
        """Every sequence takes n more tokens (a forward appended n rows to each)."""
        self.check_room(n)
        self._lens[self._at:self._at + self.batch] = [length + n for length in self.lengths]

    def truncate(self, n: int | list[int]) -> None:
        """Roll back to n tokens (every sequence), or to n[b] tokens for sequence b."""
        ns = n if isinstance(n, list) else [n] * self.batch
        lens = self.lengths
        if len(ns) != self.batch or any(not 0 <= m <= length for m, length in zip(ns, lens)):
            raise ValueError(f"{self.name}: cannot truncate to {n}; it holds {lens if self.batch > 1 else lens[0]} tokens")
        self._lens[self._at:self._at + self.batch] = ns

    def reset(self) -> None:
        self.truncate(0)

    def move(self, src: int, dst: int) -> None:
        """Sequence src's rows and length into slot dst (the batched engine keeps its live rows first)."""
        n = self._lens[self._at + src]
        self.rows[:, dst, :n] = self.rows[:, src, :n]
        self._lens[self._at + dst] = n

    def valid(self) -> torch.Tensor:
        """[num_layers, 1, length, W]: a one-sequence cache's rows in use (tests, inspection)."""
        return self.rows[:, :, : self.length]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token of every sequence takes (all layers)."""
        return self.num_layers * self.batch * self.row_width * self.rows.element_size()

    @property
    def nbytes_allocated(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def nbytes_used(self) -> int:
        return sum(self.lengths) * self.num_layers * self.row_width * self.rows.element_size()

    def __repr__(self) -> str:
        held = f"{self.length}" if self.batch == 1 else f"{self.lengths}"
        return (f"KVCache({self.name}: {self.num_layers} layers x {self.row_width} values/token, "
                f"{held}/{self.max_len} tokens, {self.nbytes_allocated / 2**20:.1f} MiB allocated)")
