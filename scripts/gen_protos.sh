#!/usr/bin/env bash
# Regenerate the committed Python code of protos/*.proto into testbed/ps/ (grpcio-tools, pinned in
# pyproject's dev extra). tests/test_protos.py runs this into a temporary directory and compares.
#   scripts/gen_protos.sh [output dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-testbed/ps}
"${PYTHON:-python3}" -m grpc_tools.protoc -I protos --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" protos/parameter_server.proto
# protoc writes an absolute import of the sibling module; make it package-relative.
sed -i 's/^import parameter_server_pb2 as parameter__server__pb2$/from testbed.ps import parameter_server_pb2 as parameter__server__pb2/' "$out/parameter_server_pb2_grpc.py"
