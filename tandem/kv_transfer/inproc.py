"""In-process KV connector: both engines live in this process; blocks are copied tensor to
tensor, with no serialization. Receivers register with a hub under an address."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.kv_transfer.base import (
    EngineHandle,
    KVConnector,
    KVDestination,
    KVTransferError,
    block_runs,
    check_fits,
)


class InProcessKVHub:
    """Address -> receiving connector, for the engines of one process."""

    def __init__(self) -> None:
        self._receivers: dict[str, InProcessKVConnector] = {}

    def register(self, address: str, connector: InProcessKVConnector) -> None:
        self._receivers[address] = connector

    def lookup(self, address: str) -> InProcessKVConnector:
        try:
            return self._receivers[address]
        except KeyError:
            raise KVTransferError(f"no in-process KV receiver at {address!r}") from None


class InProcessKVConnector(KVConnector):
    def __init__(
        self, kv_cache: torch.Tensor, engine: EngineHandle, hub: InProcessKVHub, address: str
    ) -> None:
        super().__init__(kv_cache, engine)
        self.hub = hub
        self.address = address
        hub.register(address, self)

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        check_fits(src_block_ids, dst)
        receiver = self.hub.lookup(dst.address)
        if receiver.layout != self.layout:
            raise KVTransferError(f"KV layouts differ: {self.layout} vs {receiver.layout}")
        src_cache = self.cache.kv_cache
        dst_cache = receiver.cache.kv_cache
        dst_ids = list(dst.block_ids[: len(src_block_ids)])
        for pos, first, n in block_runs(dst_ids, max_blocks=len(dst_ids) or 1):
            src = torch.as_tensor(list(src_block_ids[pos : pos + n]), device=src_cache.device)
            dst_cache[first : first + n].copy_(src_cache.index_select(0, src))
        return len(src_block_ids) * self.layout.bytes_per_block
