"""Prefill worker: computes prompts, samples the first token, hands the KV to a decode worker.

Run it with `python -m tandem_services.prefill_worker` (or `tandem prefill-worker`); `--unified`
makes it a unified worker instead.
"""
