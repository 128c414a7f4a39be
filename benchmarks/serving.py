"""Serving benchmark: `tandem serve` against the offline engine, same workload, one run.

CPU default: the embedded SmolLM2-135M, 64 random prompts of 64 tokens, 32 output tokens
each (ignore_eos), Poisson arrivals at 2 and 4 req/s and all at once; gRPC client. Writes
JSON and PNG plots under benchmarks/results/. Any `tandem bench serve` flag overrides; add
`--paired` for per-request latency differences measured one request at a time.

    python -m benchmarks.serving                 # disaggregated (prefill + decode workers)
    python -m benchmarks.serving --unified       # one unified worker
"""

from __future__ import annotations

import sys

from tandem.bench.serve import main

DEFAULTS = ["--launch", "--compare-offline", "--request-rate", "2,4,inf"]

if __name__ == "__main__":
    argv = sys.argv[1:]
    name = "serving-unified" if "--unified" in argv else "serving-disaggregated"
    sys.exit(main([*DEFAULTS, "--name", name, *argv]))
