"""A worker's feed into the prefix-cache directory.

    engine-core process                        worker event loop
    ───────────────────                        ─────────────────
    BlockPool change ─ (added, evicted) ─▶ frame piggyback ─▶ CacheMirror.apply
                                                               ├─ mirror of the pool's index
                                                               └─ DirectoryPublisher.record
                                                                  └─ batched ─▶ directory

Prefill and unified workers publish (the scheduler routes prompts to them); decode workers
do not (nothing is routed to them by prefix). The engine process records each change of its
block pool's hash index in order and sends them with its next frame (a step's outputs or a
command's reply), so the worker learns them in the order they happened.

Full republish (at start, and whenever the directory lost this worker's entries: an outage,
a restarted server, expiry during a stall) reads the mirror, which holds exactly the changes
received so far; changes received after it were recorded after the publisher cleared its
batch and are published after it.

On drain the worker removes its entries at once (after deregistering, so the scheduler no
longer routes to it); if it dies instead, they expire `--directory-ttl-s` after its last
heartbeat.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from tandem_services.common.directory import publisher_metrics
from tandem_services.common.metrics import ScrapeCollector
from tandem_services.directory import DirectoryPublisher, make_directory
from tandem_services.worker.config import WorkerServiceConfig
from tandem_services.worker.roles import worker_role

logger = logging.getLogger(__name__)


def publishes_prefixes(config: WorkerServiceConfig) -> bool:
    """Whether this worker publishes its prefix cache (a server, a role routed by prefix,
    prefix caching on)."""
    return (
        config.directory.uses_redis
        and worker_role(config.role).publishes_prefixes
        and config.engine.cache.enable_prefix_caching
    )


class CacheMirror:
    """The engine's prefix-cache index as seen through its frames' cache events."""

    def __init__(self) -> None:
        self.hashes: dict[bytes, None] = {}
        self.publisher: DirectoryPublisher | None = None

    def apply(self, events: list[tuple[list[bytes], list[bytes]]]) -> None:
        hashes = self.hashes
        publisher = self.publisher
        for added, evicted in events:
            for h in added:
                hashes[h] = None
            for h in evicted:
                hashes.pop(h, None)
            if publisher is not None:
                publisher.record(added, evicted)

    def snapshot(self) -> list[bytes]:
        return list(self.hashes)


async def start_prefix_publishing(
    config: WorkerServiceConfig,
    mirror: CacheMirror,
    registry: CollectorRegistry | None = None,
) -> DirectoryPublisher | None:
    """Start publishing this worker's cache changes; None when it does not publish."""
    if not publishes_prefixes(config):
        return None
    directory = make_directory(config.directory)
    publisher = DirectoryPublisher(
        directory,
        config.worker_id,
        mirror.snapshot,
        max_delay_s=config.directory_publish_delay_s,
        ttl_s=config.directory.worker_ttl_s,
    )
    await publisher.start()
    mirror.publisher = publisher
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
