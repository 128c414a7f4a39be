"""KV transfer: moving a request's prompt KV from a prefill engine into a decode engine.

`base.KVConnector` is the interface (reserve, send_blocks, receive, release). Transports:
`inproc` copies between two caches of one process; `tcp` streams bytes to a decode worker's
`ReceiveKV` RPC; `cuda_ipc` writes into the decode worker's cache opened through CUDA IPC;
`nccl` sends block runs over a process group per pair (gloo for CPU caches). The last two share
the connect-once, session-per-request protocol of `session`. `transports` picks one per pair
(`choose_transport`) and bundles a worker's connectors (`KVTransports`). Submodules are
imported on use (`tcp` needs grpc).
"""
