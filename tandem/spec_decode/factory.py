"""Which proposer a `SpeculativeConfig` names: the one place that names every proposer
class, so the interface (`proposer.py`) knows none of its implementations."""

from __future__ import annotations

from tandem.config import ConfigError, SpeculativeConfig
from tandem.spec_decode.proposer import Proposer, TargetInfo


def build_proposer(
    config: SpeculativeConfig, vocab_size: int, target: TargetInfo | None = None
) -> Proposer | None:
    """The proposer `config.method` names (None without speculation). The methods that run a
    model (draft_model, eagle) need the `target` and return a `ModelProposer`
    (tandem.spec_decode.model_proposer); ConfigError without it."""
    if config.method is None:
        return None
    if config.method in ("draft_model", "eagle"):
        if target is None:
            raise ConfigError(
                f"speculative_config: method {config.method!r} runs a model on the target's "
                "workers (built by the model runner)"
            )
        check_parallel(target)
        if config.method == "draft_model":
            from tandem.spec_decode.draft_model import DraftModelProposer

            return DraftModelProposer.build(target)
        from tandem.spec_decode.eagle import EagleProposer

        return EagleProposer.build(target)
    if config.method == "ngram":
        from tandem.spec_decode.ngram import NgramProposer

        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    if config.method == "replay":
        from tandem.spec_decode.replay import ReplayProposer

        return ReplayProposer.from_file(
            config.replay_path,
            config.num_speculative_tokens,
            config.replay_acceptance,
            vocab_size,
            config.replay_seed,
        )
    raise ConfigError(f"speculative_config: no proposer for method {config.method!r}")


def check_parallel(target: TargetInfo) -> None:
    """A model proposer runs on the target's ranks with the target's TP: ConfigError for a
    `draft_tensor_parallel_size` that differs (or pipeline parallel)."""
    parallel = target.config.parallel
    tp = parallel.tensor_parallel_size
    draft_tp = target.config.speculative.draft_tensor_parallel_size
    if draft_tp and draft_tp != tp:
        raise ConfigError(
            f"speculative_config: draft_tensor_parallel_size {draft_tp} differs from the "
            f"target's tensor_parallel_size {tp}; a draft runs on the target's workers with "
            "the target's TP (leave it out or set it equal)"
        )
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("speculative decoding with pipeline parallel is not supported yet")
