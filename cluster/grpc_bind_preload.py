"""Ray's preload target (``RAY_preload_python_modules``): importing it installs
``cluster.grpc_bind`` in this worker (Serve's wildcard gRPC servers bind the node IP).
A module of its own so that importing ``cluster.grpc_bind`` (tests, docs) changes nothing."""

from cluster.grpc_bind import install

install()
