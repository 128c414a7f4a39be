"""Executors: how an engine drives its workers (one per tensor-parallel rank)."""

from tandem.executor.base import Executor
from tandem.executor.factory import create_executor
from tandem.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "UniprocExecutor", "create_executor"]
