"""The worker runtime shared by `tandem_services.prefill_worker` and
`tandem_services.decode_worker`.

A library, not a service: it has no `__main__`. One worker process holds one engine (in its
own process, reached through an AsyncMPClient) and serves the `tandem.v1.Worker` API in one of
three roles: prefill (compute the prompt, sample the first token, hand the KV to a decode
worker), decode (reserve blocks, receive KV, decode), or unified (both in one engine).

The KV hand-off's wire protocols live here, over the byte movers of `tandem.kv_transfer`:
`kv_sessions` (ConnectKV / WriteKV sessions for CUDA IPC and NCCL), `kv_tcp` (ReceiveKV: the
bytes in the messages), `kv_transports` (a worker's connectors by transport name) and
`kv_standalone` (a receiver without an engine, for benchmarks and tests).
"""
