"""Speculative decoding: proposers that draft tokens and the rejection sampler that verifies
them against the target (the runner's side; the scheduler's side is in tandem.core).

    step N:   target verifies [last token, d0 .. d{k-1}] -> logits at k + 1 rows
              rejection_sampler -> 1 + a tokens (a drafts accepted, then the target's own)
    host:     proposer.propose(request states) -> drafts for step N + 1

- `proposer`: the `Proposer` interface and `build_proposer` (by `SpeculativeConfig.method`);
- `ngram`: prompt lookup over the request's own tokens (numpy, on the host);
- `replay`: a recorded greedy continuation, each token kept with probability p (benchmarks);
- `rejection_sampler`: the verification on the device, beside a per-request torch reference.
"""
