"""KV transfer: moving a request's prompt KV from a prefill engine into a decode engine.

`base.KVConnector` is the interface (reserve, send_blocks, receive, release); `inproc` copies
between two caches of one process, `tcp` streams bytes to a decode worker's `ReceiveKV` RPC.
Submodules are imported on use (`tcp` needs grpc).
"""
