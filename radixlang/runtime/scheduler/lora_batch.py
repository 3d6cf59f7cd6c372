"""The scheduler's side of LoRA: the adapter a request runs under, how many adapters a batch holds, and
the radix-cache namespace that keeps each adapter's KV apart.

The same tokens give other keys and values under another adapter (q/k/v projections change), so a prefix
cached under adapter A is never matched by a request under B or under the base model: each adapter id
(never reused, runtime/lora/manager.py) is a namespace of the tree of its own.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from radixlang.runtime.io_struct import LoRAUpdateOut, LoRAUpdateReq, check_lora_name
from radixlang.runtime.lora.adapter import AdapterError
from radixlang.runtime.lora.manager import LoRAManager
from radixlang.runtime.scheduler.batch import Req

_NOT_ENABLED = "LoRA adapters are not enabled on this server: start it with --enable-lora or --lora-paths"


def cache_namespace(rope_key: Hashable | None, lora_id: int | None) -> tuple | None:
    """The radix namespace of a request: its rotary key's (models/layers/rotary.py), apart per adapter."""
    if lora_id is None:
        return rope_key  # type: ignore[return-value]
    return ("lora", lora_id, rope_key)


class BatchAdapters:
    def __init__(self, manager: LoRAManager | None, *, max_per_batch: int) -> None:
        self.manager = manager
        self.max_per_batch = max_per_batch

    def check(self, name: str | None) -> None:
        """A RequestError naming ``lora_path`` unless ``name`` is None or a served adapter."""
        check_lora_name(name, enabled=self.manager is not None, served=self.manager.names if self.manager else ())

    def id_of(self, name: str | None) -> int | None:
        if name is None or self.manager is None:
            return None
        return self.manager.id_of(name)

    def admit(self, req: Req, running: Sequence[Req], batch: Sequence[Req]) -> bool:
        """Whether ``req`` may join this prefill batch: its adapter fits ``max_per_batch`` beside those of the
        running requests and the batch so far, and its weights are (now) loaded."""
        if req.lora_id is None or self.manager is None:
            return True
        active = {r.lora_id for r in (*running, *batch) if r.lora_id is not None}
        if req.req_pool_idx is not None:  # a chunked prefill going on: its adapter was admitted with it
            if not self.manager.ensure_loaded(req.lora_id, pinned=active | {req.lora_id}):
                raise RuntimeError(f"LoRA adapter id {req.lora_id} of a prefill in progress was evicted")
            return True
        if req.lora_id not in active and len(active) >= self.max_per_batch:
            return False
        return self.manager.ensure_loaded(req.lora_id, pinned=active)

    def update(self, msg: LoRAUpdateReq) -> LoRAUpdateOut:
        """Load (``msg.path`` set) or unload an adapter; the reply says why not, never raises for bad input."""
        if self.manager is None:
            return LoRAUpdateOut(success=False, message=_NOT_ENABLED, rid=msg.rid)
        try:
            if msg.path is not None:
                self.manager.register(msg.name, msg.path)
                message = f"loaded LoRA adapter {msg.name!r}"
            else:
                self.manager.unregister(msg.name)
                message = f"unloaded LoRA adapter {msg.name!r}"
        except (AdapterError, OSError) as e:
            return LoRAUpdateOut(success=False, message=str(e), adapters=self.listed(), rid=msg.rid)
        return LoRAUpdateOut(success=True, message=message, adapters=self.listed(), rid=msg.rid)

    def listed(self) -> dict[str, str]:
        return {} if self.manager is None else self.manager.listed()
