"""KV transfer: moving a request's prompt KV from a prefill engine into a decode engine.

`base.KVConnector` is the interface (reserve, send_blocks, receive, release), with the block
run arithmetic and `KVCacheView` (whole blocks of a cache as bytes). `inproc` copies between
two caches of one process. `mover.KVMover` is the byte mover under the hand-off sessions:
`cuda_ipc.CudaIpcMover` writes into the decode worker's cache opened through CUDA IPC,
`nccl.NcclMover` sends block runs over a process group per pair (gloo for CPU caches).
`placement` picks a transport per pair (`choose_transport`, no torch); `transports` says which
a worker can speak and builds its movers. No gRPC and no protos here: the session protocol
(ConnectKV / WriteKV), the TCP connector (ReceiveKV) and the bundle of a worker's connectors
live in the worker service (`tandem_services.worker.kv_sessions`, `kv_tcp`, `kv_transports`).
"""
