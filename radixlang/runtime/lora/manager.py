"""LoRAManager: the adapters one model runner serves, by name, and the rows of each step that use them.

An adapter is registered by name (``--lora-paths name=path`` at start, ``/load_lora_adapter`` at run time)
and gets an id that never changes meaning: a re-registered name gets a new id, so KV cached under the old
weights is never reused (the scheduler keys the radix cache by id). Registering reads and checks the
folder (every tensor maps onto a linear of this model, shapes agree), so a bad adapter fails at once.

At most ``max_loaded`` adapters hold weights at a time (LRU: the adapter loaded longest ago whose requests
are not running goes first; an evicted adapter is read again from its folder when a request needs it). A
request queued under a name that was then unregistered still runs with the weights it was sent for.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixlang.runtime.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from radixlang.runtime.lora.layer import LoRADelta, StepRows, StepRowsRef
from radixlang.runtime.models.layers.linear import Piece

logger = logging.getLogger(__name__)


_Part = tuple[Piece, torch.Tensor, torch.Tensor]  # a checkpoint module's share of a linear: (piece, A, B)


@dataclass(frozen=True)
class _Registered:
    name: str
    path: str


class LoRAManager:
    def __init__(self, model: nn.Module, *, dtype: torch.dtype, device: str, max_loaded: int | None = None) -> None:
        """``model``: a family model with ``lora_target`` (models/llama.py)."""
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loaded = max_loaded
        self.rows = StepRowsRef()
        self.names: dict[str, int] = {}  # registered name -> adapter id
        self._adapters: dict[int, _Registered] = {}  # every id ever given (queued requests may hold old ones)
        self._loaded: OrderedDict[int, list[LoRADelta]] = OrderedDict()  # id -> the deltas it set, LRU first
        self._next_id = 0
        self.evictions = 0

    # ---- names ---------------------------------------------------------------------------------------
    def register(self, name: str, path: str) -> int:
        """Read and check the adapter at ``path`` under ``name`` (AdapterError naming what is wrong); its id.
        Loaded now when there is room, else when a request first needs it."""
        if not name or ":" in name or name != name.strip():
            raise AdapterError(f"a LoRA adapter name must be non-empty, without ':' or surrounding spaces, "
                               f"got {name!r}")
        if name in self.names:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        adapter = load_adapter(path)
        plan = self._plan(adapter)
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        self._adapters[adapter_id] = _Registered(name, path)
        self.names[name] = adapter_id
        if self.max_loaded is None or len(self._loaded) < self.max_loaded:
            self._install(adapter_id, plan)
        logger.info("LoRA adapter %r (id %d) from %s: rank %d, %d modules, %.1f MiB", name, adapter_id, path,
                    adapter.rank, len(adapter.modules), adapter.num_bytes / 2**20)
        return adapter_id

    def unregister(self, name: str) -> None:
        """Forget ``name`` (AdapterError if unknown); its weights go when no running request needs them."""
        if self.names.pop(name, None) is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")

    def id_of(self, name: str) -> int:
        """The id requests naming ``name`` run under (KeyError if no such adapter is registered)."""
        return self.names[name]

    def listed(self) -> dict[str, str]:
        """Registered name -> folder."""
        return {name: self._adapters[i].path for name, i in self.names.items()}

    def state(self) -> dict[str, int]:
        """For /get_server_info: adapters registered, holding weights, evicted so far."""
        return {"registered": len(self.names), "loaded": len(self._loaded), "evictions": self.evictions}

    # ---- weights -------------------------------------------------------------------------------------
    def ensure_loaded(self, adapter_id: int, *, pinned: set[int]) -> bool:
        """Make ``adapter_id``'s weights present, evicting the least recently used adapter outside ``pinned``
        (those of running requests) if full; False when every loaded adapter is pinned."""
        if adapter_id in self._loaded:
            self._loaded.move_to_end(adapter_id)
            return True
        if self.max_loaded is not None and len(self._loaded) >= self.max_loaded:
            victim = next((i for i in self._loaded if i not in pinned), None)
            if victim is None:
                return False
            for delta in self._loaded.pop(victim):
                delta.drop_adapter(victim)
            self.evictions += 1
            logger.info("LoRA adapter id %d evicted (max_loaded_loras %d)", victim, self.max_loaded)
        reg = self._adapters[adapter_id]
        self._install(adapter_id, self._plan(load_adapter(reg.path)))
        return True

    def is_loaded(self, adapter_id: int) -> bool:
        return adapter_id in self._loaded

    def _plan(self, adapter: LoRAAdapter) -> dict[str, tuple[nn.Module, list[_Part]]]:
        """Linear path -> (the linear, its pieces' (piece, A, B)); AdapterError for a module the model lacks
        or whose shape differs."""
        plan: dict[str, tuple[nn.Module, list[_Part]]] = {}
        for module, delta in adapter.modules.items():
            target = self.model.lora_target(module)  # type: ignore[operator]
            if target is None:
                raise AdapterError(f"{adapter.path}: the adapter targets {module!r}, which this model "
                                   f"({type(self.model).__name__}) has no linear for (LoRA applies to the "
                                   f"attention and dense MLP projections)")
            path, piece = target
            linear = self.model.get_submodule(path)
            if not hasattr(linear, "lora"):
                raise AdapterError(f"{adapter.path}: {module!r} is served by a {type(linear).__name__}, which "
                                   f"LoRA does not apply to")
            in_features = int(linear.in_features)  # type: ignore[arg-type]
            if delta.a.shape[1] != in_features or delta.b.shape[0] != piece.size:
                raise AdapterError(f"{adapter.path}: {module!r} has lora_A {tuple(delta.a.shape)} and lora_B "
                                   f"{tuple(delta.b.shape)}; this model's module takes {in_features} inputs and "
                                   f"gives {piece.size} outputs (an adapter for another base model?)")
            plan.setdefault(path, (linear, []))[1].append((piece, delta.a, delta.b))
        return plan

    def _install(self, adapter_id: int, plan: dict[str, tuple[nn.Module, list[_Part]]]) -> None:
        deltas: list[LoRADelta] = []
        for linear, parts in plan.values():
            current: Any = getattr(linear, "lora")
            delta = current if isinstance(current, LoRADelta) else LoRADelta(
                self.rows, in_features=int(getattr(linear, "in_features")),
                out_features=int(getattr(linear, "out_features")))
            setattr(linear, "lora", delta)  # the linear's declared slot (layers/linear.py: OutputDelta)
            delta.set_adapter(adapter_id, parts, dtype=self.dtype, device=self.device)
            deltas.append(delta)
        self._loaded[adapter_id] = deltas

    # ---- steps ---------------------------------------------------------------------------------------
    def begin_step(self, adapter_ids: list[int | None], extend_lens: list[int],
                   keep_rows: torch.Tensor | None) -> bool:
        """Group this step's rows by adapter (``adapter_ids`` per request, ``extend_lens`` its tokens;
        ``keep_rows``: the rows the model's last layer keeps, None for all). False (nothing set) when no
        request of the step uses an adapter."""
        if all(i is None for i in adapter_ids):
            self.rows.current = None
            return False
        for i in adapter_ids:
            if i is not None and i not in self._loaded:
                raise RuntimeError(f"LoRA adapter id {i} runs in a step but is not loaded")
        per_request = torch.tensor([-1 if i is None else i for i in adapter_ids], dtype=torch.int64)
        token_ids = torch.repeat_interleave(per_request, torch.tensor(extend_lens, dtype=torch.int64))
        step = StepRows(token_groups=_on(StepRows.group(token_ids), self.device), num_tokens=int(token_ids.numel()))
        if keep_rows is not None:
            kept = token_ids[keep_rows.cpu()]
            step.kept_groups, step.num_kept = _on(StepRows.group(kept), self.device), int(kept.numel())
        self.rows.current = step
        return True

    def end_step(self) -> None:
        self.rows.current = None


def _on(groups: list[tuple[int, torch.Tensor | None]], device: str) -> list[tuple[int, torch.Tensor | None]]:
    return [(i, None if rows is None else rows.to(device)) for i, rows in groups]
