"""The frontend's API key check, shared by the HTTP and gRPC APIs."""

from __future__ import annotations

import hmac


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an `Authorization` header (or gRPC `authorization` metadata) carries
    `Bearer <api_key>`. Compared in constant time (`hmac.compare_digest` over UTF-8 bytes), so
    how long a refusal takes says nothing about how much of a guess was right."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"), expected)
