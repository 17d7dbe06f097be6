"""The K/V storage of the runners: per-layer buffers written at slots, in one arena per runner.

A forward tells the storage where to write (`Book.slots`) and how much the attention sees
(`Book.view_len`); the buffers are made at the first write, at the book's `max_len`. `SlotLayer` is
that storage as a transformers cache layer (HF attention calls `update`), `DraftSlotCache` the protocol
`Eagle3Draft`'s attention uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin


@dataclass
class Book:
    """What a runner tells its cache before each forward."""

    max_len: int = 0
    slots: torch.Tensor | None = None  # (Ts,) where this forward writes its K/V
    view_len: int = 0  # attention sees slots 0..view_len-1


class Arena:
    """One K and one V buffer (L, B, heads, max_len, D) for all L layers of a runner, made at the first
    write; a layer's K/V are views of them. Moving an accepted tree branch down is then two gathers
    and two scatters for every layer at once, not four small kernels per layer. For SmolLM2-135M on a
    GPU, the 30 layers' move replays in about an eighth of a tree round. A layer whose K/V shapes
    differ from the first layer's gets buffers of its own."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def views(self, layer: int, k: torch.Tensor, v: torch.Tensor, max_len: int):
        """This layer's (keys, values) in the arena, or None if its shapes do not fit it."""
        if self.keys is None:
            self.keys = k.new_zeros(self.num_layers, *k.shape[:2], max_len, k.shape[3])
            self.values = v.new_zeros(self.num_layers, *v.shape[:2], max_len, v.shape[3])
        keys, values = self.keys[layer], self.values[layer]
        for buf, new in ((keys, k), (values, v)):
            if (buf.shape[:2], buf.shape[3], buf.dtype, buf.device) != (new.shape[:2], new.shape[3], new.dtype,
                                                                         new.device):
                return None
        return keys, values


class Slots:
    """K/V buffers (B, heads, max_len, D) per layer, allocated on first write (in the runner's arena
    where they fit), written at book.slots."""

    def __init__(self, book: Book, arena: Arena | None = None, index: int = 0):
        self.book, self.arena, self.index = book, arena, index
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.own = True  # buffers of its own, not views of the arena

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            shared = self.arena.views(self.index, k, v, self.book.max_len) if self.arena else None
            self.own = shared is None
            self.keys, self.values = shared or (k.new_zeros(*k.shape[:2], self.book.max_len, k.shape[3]),
                                                v.new_zeros(*v.shape[:2], self.book.max_len, v.shape[3]))
        self.keys.index_copy_(2, self.book.slots, k)
        self.values.index_copy_(2, self.book.slots, v)
        n = self.book.view_len
        return self.keys[:, :, :n], self.values[:, :, :n]


class SlotLayer(CacheLayerMixin):
    """A transformers cache layer over `Slots` (HF attention calls `update`, mask code the sizes)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, book: Book, arena: Arena | None = None, index: int = 0):
        super().__init__()
        self.book, self.slots = book, Slots(book, arena, index)

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are made by Slots
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.keys, self.values = self.slots.write(key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.book.view_len, 0

    def get_query_offset(self) -> int:
        return 0

    def get_seq_length(self) -> int:
        return self.book.view_len

    def get_max_length(self) -> int:
        return self.book.max_len


class DraftSlotCache:
    """The cache protocol `Eagle3Draft`'s attention uses (`append`, `length`), over slot buffers."""

    def __init__(self, book: Book, num_layers: int):
        self.book, arena = book, Arena(num_layers)
        self.layers = [Slots(book, arena, i) for i in range(num_layers)]
        self.positions: torch.Tensor | None = None  # (B, max_len): each slot's position (a windowed draft only)

    def key_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Write the new rows' positions (B, Ts) at book.slots; -> (B, view_len) every slot's position. Slots
        never written hold 0: the runner's own mask already hides them."""
        if self.positions is None:  # made in the first (eager) forward, like the K/V buffers
            self.positions = position_ids.new_zeros(position_ids.shape[0], self.book.max_len)
        self.positions.index_copy_(1, self.book.slots, position_ids)
        return self.positions[:, :self.book.view_len]

    @property
    def length(self) -> int:  # keys before the new ones in the view the draft attends over
        return self.book.view_len - len(self.book.slots)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.layers[layer].write(k, v)
