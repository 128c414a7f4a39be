"""Optional packages: a feature that needs one fails with one line naming the extra to install.

`pip install tandem` runs everything (the offline API, `tandem serve` with its gRPC services,
HTTP API and metrics); extras add what only some deployments use:

    redis        the Redis prefix-cache directory (`--redis-url`)
    structured   structured outputs (xgrammar): response_format, guided fields
    serve        everything the served API and a full deployment may use (redis, xgrammar)
    flashinfer   `--attention-backend FLASHINFER` (flashinfer-python; CUDA)
"""

from __future__ import annotations

import importlib


class MissingExtraError(ImportError):
    """A feature's optional package is not installed; the message says which extra gives it."""


def require(module: str, extra: str, feature: str) -> None:
    """Raise MissingExtraError unless `module` imports (it is imported here, once)."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs the {module!r} package: pip install 'tandem[{extra}]'"
        ) from None
