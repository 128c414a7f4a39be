"""The global scheduler: bounded admission queue, worker registry and health, routing.

Run it with `python -m tandem_services.scheduler` (or `tandem scheduler`).
"""
