"""The scheduler's side of the directory: look up cached prefixes, route, never fail.

`PrefixRouter.cached_blocks` asks the directory for each worker's cached prefix of the
prompt's block-hash chain (what `PrefixAwareRouting.lookup` awaits); `PrefixRouter.route`
then lets a `PrefillChooser` choose. When the directory is unavailable
it routes on load alone (`cached_blocks = {}`), counts a fallback, warns once per outage,
and for `retry_after_s` does not ask again (so a dead server costs each request nothing,
not a timeout); then it probes once more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tandem_services.directory.base import DirectoryUnavailable, PrefixDirectory
from tandem_services.scheduler.routing.cost import (
    CostModelChooser,
    PrefillChooser,
    RoutingDecision,
    WorkerLoad,
)

logger = logging.getLogger(__name__)


class PrefixRouter:
    """Routes prompts with a `PrefixDirectory` and a chooser (default: `CostModelChooser`)."""

    def __init__(
        self,
        directory: PrefixDirectory,
        block_size: int,
        chooser: PrefillChooser | None = None,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.directory = directory
        self.block_size = block_size
        self.chooser: PrefillChooser = chooser or CostModelChooser()
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._skip_until = float("-inf")
        self._degraded = False
        # Counters (exported as metrics by the service).
        self.num_routed = 0
        self.num_fallbacks = 0

    @property
    def degraded(self) -> bool:
        """True while the last directory lookup failed (routing on load alone)."""
        return self._degraded

    async def cached_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, int] | None:
        """Per worker, leading blocks of the chain it holds; None when the directory is down."""
        if self._clock() < self._skip_until:
            return None
        try:
            cached = await self.directory.longest_prefix(block_hashes)
        except DirectoryUnavailable as exc:
            self._skip_until = self._clock() + self.retry_after_s
            if not self._degraded:
                self._degraded = True
                logger.warning("prefix directory unavailable, routing on load alone: %s", exc)
            return None
        if self._degraded:
            self._degraded = False
            logger.info("prefix directory back, routing on cached prefixes again")
        return cached

    async def route(
        self,
        block_hashes: Sequence[bytes],
        candidates: Sequence[WorkerLoad],
        num_prompt_tokens: int,
    ) -> RoutingDecision:
        """Choose a worker among `candidates` (non-empty) for a prompt with this hash chain."""
        if not candidates:
            raise ValueError("no candidate workers")
        cached = await self.cached_blocks(block_hashes) if block_hashes else {}
        self.num_routed += 1
        if cached is None:
            self.num_fallbacks += 1
            decision = self.chooser.choose(candidates, {}, num_prompt_tokens, self.block_size)
            return RoutingDecision(
                decision.worker_id, decision.cost, decision.num_cached_tokens, False
            )
        return self.chooser.choose(candidates, cached, num_prompt_tokens, self.block_size)
