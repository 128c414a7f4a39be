"""One device rank of an engine.

- `worker`: `Worker` — device selection (made current on the engine's thread), distributed
  set-up (placeholder), memory profiling and KV sizing, the one KV cache allocation;
- `model_runner`: `ModelRunner` — builds a step's device inputs and runs the model;
- `input_batch`: per-request persistent state, block table rows, a step's host arrays
  (positions, slot mapping, ...);
- `cuda_graph`: decode CUDA graphs (buckets, shared pool, static inputs, eager fallback);
- `sampling`: sampling metadata, seeded generators, sampled ids to host, `PendingStep`;
- `staging`: host -> device copies through pinned buffers.
"""
