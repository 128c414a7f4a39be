"""The frontend: the gRPC `Generate` API and an OpenAI-compatible HTTP API.

Run it with `python -m tandem_services.frontend` (or `tandem frontend`). It tokenizes, submits token
ids to the scheduler, receives outputs straight from the workers on one stream per worker,
detokenizes incrementally, applies stop strings, and streams to clients.
"""
