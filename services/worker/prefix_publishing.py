"""A worker's feed into the prefix-cache directory.

    engine thread                                  event loop
    ─────────────                                  ──────────
    BlockPool change ─ on_cache_event(added, evicted) ─▶ DirectoryPublisher.record (no I/O)
                                                         └─ batch every ≤ delay ─▶ directory

Prefill and unified workers publish (the scheduler routes prompts to them); decode workers
do not (nothing is routed to them by prefix). The listener runs on the engine thread inside
the block pool's operation: `record` only takes a lock and updates a dict, so a step pays
a few microseconds for it.

Full republish (at start, and whenever the directory lost this worker's entries: an outage,
a restarted server, expiry during a stall) reads the pool's hash index from the event loop
thread: `cached_block_hashes()` copies the index in one C-level call, which holds the GIL
throughout, so it sees the index between two of the engine's changes. Changes made after
the copy were recorded after the publisher cleared its batch and are published after it.

On drain the worker removes its entries at once (after deregistering, so the scheduler no
longer routes to it); if it dies instead, they expire `--directory-ttl-s` after its last
heartbeat.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.directory import publisher_metrics
from services.common.metrics import ScrapeCollector
from services.worker.config import WorkerServiceConfig
from tandem.core.block_pool import BlockPool
from tandem.directory import DirectoryPublisher, make_directory
from tandem.engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)


def publishes_prefixes(config: WorkerServiceConfig) -> bool:
    """Whether this worker publishes its prefix cache (a server, a role routed by prefix,
    prefix caching on)."""
    return (
        config.directory.uses_redis
        and config.role in ("prefill", "unified")
        and config.engine.cache.enable_prefix_caching
    )


def _held_hashes(pool: BlockPool) -> list[bytes]:
    for _ in range(8):
        try:
            return pool.cached_block_hashes()
        except RuntimeError:  # the index changed during the copy (no GIL): try again
            continue
    return pool.cached_block_hashes()


async def start_prefix_publishing(
    config: WorkerServiceConfig,
    engine_thread: EngineThread[Any],
    registry: CollectorRegistry | None = None,
) -> DirectoryPublisher | None:
    """Start publishing this worker's cache changes; None when it does not publish."""
    if not publishes_prefixes(config):
        return None
    directory = make_directory(config.directory)
    pool: BlockPool = await engine_thread.call(lambda e: e.scheduler.kv_cache_manager.block_pool)
    publisher = DirectoryPublisher(
        directory,
        config.worker_id,
        lambda: _held_hashes(pool),
        max_delay_s=config.directory_publish_delay_s,
        ttl_s=config.directory.worker_ttl_s,
    )
    await publisher.start()

    def attach(_: Any) -> None:
        pool.on_cache_event = publisher.record

    await engine_thread.call(attach)
    if registry is not None:
        registry.register(ScrapeCollector(lambda: publisher_metrics(publisher)))
    logger.info(
        "worker %s publishes its prefix cache to %s (batches within %.0f ms)",
        config.worker_id,
        config.directory.redis_url,
        config.directory_publish_delay_s * 1000,
    )
    return publisher


async def stop_prefix_publishing(publisher: DirectoryPublisher | None) -> None:
    """Stop publishing and remove this worker's entries (never raises on a lost server)."""
    if publisher is None:
        return
    try:
        await publisher.stop(remove=True)
    except Exception:
        logger.exception("stopping the directory publisher failed")
    finally:
        await publisher.directory.close()
