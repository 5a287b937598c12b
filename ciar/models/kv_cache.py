"""Static KV cache: preallocated, written at explicit positions, rolled back by moving a position pointer.

Layout per layer: k, v [slots, n_kv_head, max_seq, head_dim] (heads before positions, as attention reads them:
a slot's keys for one head are one contiguous block, so attention walks memory in order). A *slot* is one sequence (a session, or one CFG
row of it). `key_valid` [slots, max_seq] marks caption padding (False) so padded caption tokens are never
attended to; image positions are always valid. Nothing is ever copied for rollback: attention masks keys
beyond each query's own position, so entries past a rolled-back pointer are invisible and get overwritten.

`lengths` is a host-side list of how many positions of each slot hold committed tokens (no device sync in the
hot loop); it changes only through the cache's own methods: `set_length` after a forward wrote positions,
`rollback` to drop a suffix, `reset` to free slots.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layer: int, slots: int, max_seq: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (slots, n_kv_head, max_seq, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.key_valid = torch.ones(slots, max_seq, dtype=torch.bool, device=device)  # [slots, max_seq]
        self.lengths = [0] * slots
        self.slots, self.max_seq = slots, max_seq

    @property
    def device(self) -> torch.device:
        return self.key_valid.device

    def reset(self, slots: list[int] | None = None) -> None:
        """Free slots (all when None): they hold nothing afterwards."""
        for s in range(self.slots) if slots is None else slots:
            self.lengths[s] = 0
            self.key_valid[s] = True

    def set_length(self, slots, length: int) -> None:
        """Slots `slots` (an int or an iterable of ints) now hold `length` committed positions (after a forward
        wrote them, or a session's state was rebuilt)."""
        if not 0 <= length <= self.max_seq:
            raise ValueError(f"length must be in [0, {self.max_seq}], got {length}")
        for s in [slots] if isinstance(slots, int) else slots:
            self.lengths[s] = length

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (moves the pointer; copies nothing)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]} positions")
        self.lengths[slot] = length

    def copy_slot(self, src: int, dst: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
        self.key_valid[dst].copy_(self.key_valid[src])
        self.lengths[dst] = self.lengths[src]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
