"""KV memory: ReqToTokenPool (request slot -> row of KV slot indices) and TokenToKVPool.

Token-granular and paged only logically: any free slot can hold any token.
Slot 0 of the KV pool is a reserved dummy (padding target), never handed out.
``MLATokenToKVPool`` holds multi-head latent attention's compressed cache (DeepSeek-V2/V3): one latent
row per token and layer, whose leading features double as the value (no separate value buffer).
The scheduler owns both pools; attention backends only read and write slots.
"""
from __future__ import annotations

import torch


class ReqToTokenPool:
    """``size`` request rows to hand out, plus one reserved padding row (``pad_index``, the last) that is
    never handed out: CUDA-graph padding requests read it (all zeros: the dummy KV slot 0)."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.pad_index = size
        # [size + 1, max_context_len] int32: KV slot of each token of each running request; row size pads
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self._free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self, need: int = 1) -> list[int] | None:
        if need > len(self._free_slots):
            return None
        taken, self._free_slots = self._free_slots[:need], self._free_slots[need:]
        return taken

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise RuntimeError(f"req slot {index} is outside the pool [0, {self.size})")
        if index in self._free_slots:
            raise RuntimeError(f"double free of req slot {index}")
        self._free_slots.append(index)

    def clear(self) -> None:
        self._free_slots = list(range(self.size))


class TokenToKVPool:
    # one slot space for every layer: no window layer reads through a second one (swa_memory_pool.py)
    full_to_swa: torch.Tensor | None = None

    def __init__(self, size: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device,
                 layer_shapes: list[tuple[int, int]] | None = None) -> None:
        """``layer_shapes``: each layer's (num_kv_heads, head_dim) when they differ between layers;
        otherwise every layer holds num_kv_heads x head_dim."""
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        shapes = layer_shapes or [(num_kv_heads, head_dim)] * num_layers
        if len(shapes) != num_layers:
            raise ValueError(f"layer_shapes has {len(shapes)} entries for {num_layers} layers")
        self.layer_shapes = list(shapes)
        # per layer [size + 1, its kv heads, its head_dim]; slot 0 is the dummy slot
        self.k_buffer = [torch.zeros((size + 1, h, d), dtype=dtype, device=device) for h, d in shapes]
        self.v_buffer = [torch.zeros((size + 1, h, d), dtype=dtype, device=device) for h, d in shapes]
        self.per_token_bytes = self.layers_bytes_per_token(shapes, dtype)
        self._init_free()

    def _init_free(self) -> None:
        size = self.size
        self._free = torch.ones(size + 1, dtype=torch.bool)  # host-side free map
        self._free[0] = False
        self._free_slots = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, need: int) -> torch.Tensor | None:
        """Return `need` free slot indices (int64, host) or None when the pool is short."""
        if need > self._num_free:
            return None
        if need == 0:
            return torch.empty(0, dtype=torch.int64)
        if self._free_slots.numel() < need:
            self._free_slots = torch.nonzero(self._free).flatten()
        out = self._free_slots[:need]
        self._free_slots = self._free_slots[need:]
        self._free[out] = False
        self._num_free -= need
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).cpu()
        if not bool((indices > 0).all()):
            raise RuntimeError("the dummy KV slot 0 is never freed")
        if bool(self._free[indices].any()):
            raise RuntimeError(f"double free of KV slots {indices[self._free[indices]].tolist()[:8]}")
        self._free[indices] = True
        self._free_slots = torch.cat([self._free_slots, indices])
        self._num_free += indices.numel()

    def clear(self) -> None:
        self._free.fill_(True)
        self._free[0] = False
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._num_free = self.size

    def is_swa_layer(self, layer_id: int) -> bool:
        return False

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc [n] int64; k, v [n, num_kv_heads, head_dim]
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    @property
    def total_bytes(self) -> int:
        """What the k and v buffers hold, the dummy slot included."""
        return self.per_token_bytes * (self.size + 1)

    @staticmethod
    def bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @staticmethod
    def layers_bytes_per_token(layer_shapes: list[tuple[int, int]], dtype: torch.dtype) -> int:
        """k + v bytes one token takes over layers of the given (num_kv_heads, head_dim)."""
        return 2 * sum(h * d for h, d in layer_shapes) * torch.empty(0, dtype=dtype).element_size()


class MLATokenToKVPool(TokenToKVPool):
    """Multi-head latent attention's cache: per layer [size + 1, 1, latent_dim] (the normed compressed kv,
    then the rotated shared key: kv_lora_rank + qk_rope_head_dim features), one "kv head" every query
    head attends to. The value is the latent's first ``value_dim`` features: ``get_value_buffer`` returns
    a view of the key buffer, so a token costs latent_dim values per layer, not k + v per head."""

    def __init__(self, size: int, *, num_layers: int, latent_dim: int, value_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        if not 0 < value_dim <= latent_dim:
            raise ValueError(f"the value ({value_dim} features) must be a leading part of the latent ({latent_dim})")
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.latent_dim, self.value_dim = latent_dim, value_dim
        self.layer_shapes = [(1, latent_dim)] * num_layers
        self.k_buffer = [torch.zeros((size + 1, 1, latent_dim), dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [k[..., :value_dim] for k in self.k_buffer]  # views: nothing stored twice
        self.per_token_bytes = self.latent_bytes_per_token(num_layers=num_layers, latent_dim=latent_dim, dtype=dtype)
        self._init_free()

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc [n] int64; k [n, 1, latent_dim]; v is k's leading value_dim features and lands with it
        self.k_buffer[layer_id][loc] = k.to(self.dtype)

    @staticmethod
    def latent_bytes_per_token(*, num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * latent_dim * torch.empty(0, dtype=dtype).element_size()
