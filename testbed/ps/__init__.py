"""The gRPC parameter server: protocol code, server, client and the local launcher of servers.

``parameter_server_pb2*.py`` are generated from ``protos/parameter_server.proto`` by
``scripts/gen_protos.sh`` and committed.
"""
