"""Speculative decoding: proposers that draft tokens and the rejection sampler that verifies
them against the target (the runner's side; the scheduler's side is in tandem.core).

    step N:   target verifies [last token, d0 .. d{k-1}] -> logits at k + 1 rows
              rejection_sampler -> 1 + a tokens (a drafts accepted, then the target's own)
    host:     proposer.propose(request states) -> drafts for step N + 1

- `proposer`: the `Proposer` interface; `factory`: `build_proposer` (by
  `SpeculativeConfig.method`);
- `ngram`: prompt lookup over the request's own tokens (numpy, on the host);
- `model_proposer`: proposers that run a model on the target's device, their KV cache
  indexed by the target's block ids (the runner's seam: `ModelRunner._step_proposer`);
- `draft_model`: a small model of the target's vocabulary, k greedy steps per engine step;
- `eagle`: an EAGLE-1 head fed the target's hidden states;
- `replay`: a recorded greedy continuation, each token kept with probability p (benchmarks);
- `rejection_sampler`: the verification on the device, beside a per-request torch reference.
"""
