#!/usr/bin/env bash
# Regenerates the Python gRPC stubs for app/proto/llm_lanes/v1/llm_lanes.proto.
#
#   app/proto/generate.sh            (from anywhere; uses .venv/bin/python when present)
#   PYTHON=python3 app/proto/generate.sh
#
# Needs grpcio-tools (the `test` extra). The stubs are committed, so serving does not need it.
#
# The proto is compiled with `-I app/proto`, so its descriptor name is
# "llm_lanes/v1/llm_lanes.proto" (what reflection clients such as grpcurl see) and protoc
# writes `from llm_lanes.v1 import llm_lanes_pb2`; the sed below turns that into the package
# import `from app.proto.llm_lanes.v1 import llm_lanes_pb2` so the stubs import as
# app.proto.llm_lanes.v1.llm_lanes_pb2 / llm_lanes_pb2_grpc.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo_root"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

proto_root=app/proto
out_dir="$proto_root/llm_lanes/v1"

"$PYTHON" -m grpc_tools.protoc \
  -I "$proto_root" \
  --python_out="$proto_root" \
  --pyi_out="$proto_root" \
  --grpc_python_out="$proto_root" \
  llm_lanes/v1/llm_lanes.proto

sed -i -E 's/^from llm_lanes\.v1 import /from app.proto.llm_lanes.v1 import /' \
  "$out_dir/llm_lanes_pb2_grpc.py"
# The message classes' __module__ must be their real import path: Ray pickles the request message by reference
# when the gRPC proxy hands it to the Router replica.
sed -i -E "s/'llm_lanes\.v1\.llm_lanes_pb2'/'app.proto.llm_lanes.v1.llm_lanes_pb2'/" "$out_dir/llm_lanes_pb2.py"

# Fail loudly if the rewrite missed something (e.g. a new protoc import style).
if grep -nE '^(from|import) llm_lanes' "$out_dir"/llm_lanes_pb2*.py; then
  echo "generate.sh: unrewritten llm_lanes import left in the stubs" >&2
  exit 1
fi

"$PYTHON" -c "import app.proto.llm_lanes.v1.llm_lanes_pb2_grpc as g; g.add_LlmLanesServicer_to_server"
echo "generated $out_dir/llm_lanes_pb2.py, llm_lanes_pb2.pyi, llm_lanes_pb2_grpc.py"
