"""Stored responses of OpenAI's Responses API (`store`, `previous_response_id`,
`client.responses.retrieve` / `.delete`), kept by the frontend that answered them.

Each stored response keeps the response object as sent and the conversation it closes, as
Responses input items: the stored items of its `previous_response_id` (if any), then its own
input, then its output items (the assistant's message, its function calls). A request naming
`previous_response_id` is answered over those items followed by its own input; the earlier
response's `instructions` are not carried over (OpenAI's rule: each request states its own).

Bounded: the `capacity` most recently stored or used responses (LRU); an evicted or deleted
response is not found (404). In memory and per frontend process: with several frontend
replicas behind one address, a follow-up must reach the replica that stored its
predecessor (sticky sessions), else it is not found. Capacity 0 turns storing off: `store`
is answered false and `previous_response_id` is refused by name.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the object as sent, and the conversation's input items through
    its output (read-only: later conversations copy the list, never change it)."""

    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]


class ResponseStore:
    """The last `capacity` stored responses by id, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
