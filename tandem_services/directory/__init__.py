"""Prefix-cache directory (which worker holds which KV block) and the workers' publisher.

Routing on it (the cost model, the policies, the lookup that never fails) is the scheduler
service's: tandem_services/scheduler/routing/.

Importing this package does not import redis; `RedisDirectory` lives in
`tandem_services.directory.redis_directory` and `make_directory` imports it only when a URL is set.
"""

from __future__ import annotations

from tandem_services.directory.base import DirectoryUnavailable, PrefixDirectory
from tandem_services.directory.factory import DirectoryConfig, make_directory
from tandem_services.directory.memory import InMemoryDirectory
from tandem_services.directory.publisher import DirectoryPublisher

__all__ = [
    "DirectoryConfig",
    "DirectoryPublisher",
    "DirectoryUnavailable",
    "InMemoryDirectory",
    "PrefixDirectory",
    "make_directory",
]
