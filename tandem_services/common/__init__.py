"""Plumbing shared by the services: gRPC server set-up (health, reflection), signals, the actor
pattern, and proto <-> dataclass conversion. A library, not a service (it has no `__main__`);
services import it and `tandem_protos`, never each other.
"""
