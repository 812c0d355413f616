#!/usr/bin/env bash
# Regenerates src/gen/ (ts-proto through buf, both npm devDependencies: no protoc needed)
# from the repository's proto/ directory. The generated code is committed, so building the
# package needs only tsc; test.sh checks that it matches the protos.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/copy-protos.sh
rm -rf src/gen
node_modules/.bin/buf generate
