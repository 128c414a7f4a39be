"""Decode worker: reserves blocks, receives prompt KV from prefill workers, decodes in its
running batch. Run it with `python -m tandem_services.decode_worker` (or `tandem decode-worker`);
`--unified` makes it a unified worker (prefill and decode in one engine) instead.
"""
