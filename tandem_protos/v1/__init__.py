"""tandem.v1 messages and services.

    from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
"""
