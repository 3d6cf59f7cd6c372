"""The in-memory store behind ``store`` / ``previous_response_id`` on /v1/responses.

Bounded: at most ``capacity`` responses, the least recently used dropped first; lost on restart and
not shared between servers (a client that needs more keeps its own history and sends it as input).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

DEFAULT_CAPACITY = 1024


class StoredResponse(NamedTuple):
    response: dict[str, Any]  # the Response object as it was returned
    messages: list[dict[str, Any]]  # the conversation as chat messages (no instructions), reply included
    calls: dict[str, str]  # call_id -> function name of every call in ``messages``


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # the Engine's front may call from several threads

    def put(self, response_id: str, item: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
