"""tandem: high-throughput LLM inference and serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.runtime_env import set_openmp_defaults

set_openmp_defaults()  # before anything loads torch (see tandem/runtime_env.py)

from tandem.engine.beam_search import BeamSearchParams  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from tandem.engine.llm import LLM

__all__ = ["LLM", "BeamSearchParams", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls torch; keep `import tandem` light for torch-free users (core, services).
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    raise AttributeError(name)
