"""SWATokenToKVPool: KV for models whose sliding-window layers need only the last ``window`` tokens.

Full-attention layers keep k/v over the token slot space (``size`` slots, as ``TokenToKVPool``);
window layers keep theirs over a smaller swa slot space (``swa_size`` slots). Every token has a full
slot (what ``req_to_token`` and the radix tree hold) and, while some query may still see it in a window
layer, an swa slot: ``full_to_swa[full slot]`` (0, the dummy slot, once freed). ``alloc`` hands out both,
``free`` frees both (the swa part where still held), ``free_swa`` only the swa part: a token no window can
reach any more keeps its full-layer KV for as long as its full slot lives.

Attention backends write and read window layers through the mapping (``is_swa_layer``, ``full_to_swa``);
a freed token reads the dummy slot, which a correct window never lets a query see.
"""
from __future__ import annotations

import torch

from radixlang.runtime.mem_cache.memory_pool import TokenToKVPool


class SWATokenToKVPool(TokenToKVPool):
    """A ``TokenToKVPool`` to the scheduler and the backends (``size`` is the full slots); its buffers live in
    two inner pools, ``full`` and ``swa``."""

    def __init__(self, size: int, swa_size: int, *, layer_windows: list[int | None],
                 layer_shapes: list[tuple[int, int]], dtype: torch.dtype, device: str | torch.device) -> None:
        """``layer_windows[i]``: layer i's window in tokens, or None for a full-attention layer."""
        if len(layer_windows) != len(layer_shapes):
            raise ValueError(f"{len(layer_windows)} layer windows for {len(layer_shapes)} layer shapes")
        if not any(layer_windows):
            raise ValueError("an swa pool needs at least one sliding-window layer")
        if not 0 < swa_size <= size:
            raise ValueError(f"swa_size must be in [1, {size}] (the full slots), got {swa_size}")
        self.size, self.swa_size = size, swa_size
        self.num_layers = len(layer_shapes)
        self.dtype, self.device = dtype, device
        self.layer_shapes = list(layer_shapes)
        self.window = max(w for w in layer_windows if w)  # the longest window: what trimming must keep
        swa_ids = [i for i, w in enumerate(layer_windows) if w]
        full_ids = [i for i, w in enumerate(layer_windows) if not w]
        # each layer's (pool, index in that pool)
        self.full = TokenToKVPool(size, num_layers=len(full_ids), num_kv_heads=0, head_dim=0, dtype=dtype,
                                  device=device, layer_shapes=[layer_shapes[i] for i in full_ids])
        self.swa = TokenToKVPool(swa_size, num_layers=len(swa_ids), num_kv_heads=0, head_dim=0, dtype=dtype,
                                 device=device, layer_shapes=[layer_shapes[i] for i in swa_ids])
        self._layer = {i: (self.full, j) for j, i in enumerate(full_ids)}
        self._layer.update({i: (self.swa, j) for j, i in enumerate(swa_ids)})
        self._swa_layers = frozenset(swa_ids)
        # [size + 1] int64 on the device: swa slot of each full slot, 0 where none (slot 0 -> 0 always)
        self.full_to_swa = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.per_token_bytes = self.full.per_token_bytes + self.swa.per_token_bytes

    # ---- slots ---------------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def alloc(self, need: int) -> torch.Tensor | None:
        """``need`` full slots [need] int64 (host), each with an swa slot; None when either space is short."""
        if need > self.full.available_size() or need > self.swa.available_size():
            return None
        full, swa = self.full.alloc(need), self.swa.alloc(need)
        if full is None or swa is None:
            raise RuntimeError("the slot counts said both spaces had room")
        self.full_to_swa[full.to(self.full_to_swa.device)] = swa.to(self.full_to_swa.device)
        return full

    def free(self, indices: torch.Tensor) -> None:
        """Free full slots and the swa slots they still hold."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).cpu()
        swa = self.full_to_swa[indices.to(self.full_to_swa.device)].cpu()
        self.full.free(indices)  # raises on a double free before anything else changes
        held = swa > 0
        self.swa.free(swa[held])
        self.full_to_swa[indices[held].to(self.full_to_swa.device)] = 0

    def free_swa(self, indices: torch.Tensor) -> None:
        """Free the swa slots of full slots whose tokens no window query can see any more (full KV stays)."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).cpu()
        swa = self.full_to_swa[indices.to(self.full_to_swa.device)].cpu()
        if not bool((swa > 0).all()):
            raise RuntimeError(f"double free of the swa KV of full slots {indices[swa == 0].tolist()[:8]}")
        self.swa.free(swa)
        self.full_to_swa[indices.to(self.full_to_swa.device)] = 0

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Give each ``dst`` full slot (holding no swa KV) the swa slot of ``src`` (same tokens, same KV):
        a cached copy without window KV takes over a running request's."""
        src, dst = src.to(self.full_to_swa.device), dst.to(self.full_to_swa.device)
        moved = self.full_to_swa[src]
        if bool((moved == 0).any()) or bool((self.full_to_swa[dst] != 0).any()):
            raise RuntimeError("move_swa needs swa KV at every source and none at any destination")
        self.full_to_swa[dst] = moved
        self.full_to_swa[src] = 0

    def has_swa(self, indices: torch.Tensor) -> torch.Tensor:
        """[n] bool (host): which full slots still hold swa KV."""
        return self.full_to_swa[indices.to(torch.int64).to(self.full_to_swa.device)].cpu() > 0

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()

    # ---- buffers -------------------------------------------------------------------------------
    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self._swa_layers

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, j = self._layer[layer_id]
        return pool.k_buffer[j]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, j = self._layer[layer_id]
        return pool.v_buffer[j]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``loc`` [n] int64 full slots; a window layer's k/v land in their swa slots."""
        pool, j = self._layer[layer_id]
        if pool is self.swa:
            loc = self.full_to_swa[loc]
        pool.set_kv_buffer(j, loc, k, v)

    @property
    def total_bytes(self) -> int:
        """What the k and v buffers of both spaces hold, the dummy slots included."""
        return self.full.total_bytes + self.swa.total_bytes
