"""tandem: high-throughput LLM inference and serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls torch; keep `import tandem` light for torch-free users (core, services).
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    raise AttributeError(name)
