#!/usr/bin/env bash
# Builds dist/: the compiled ESM + .d.ts, and the .proto files (dist/proto/) for users who
# want them (reflection-free tools, other languages). The generated code in src/gen/ is
# committed (scripts/gen.sh makes it), so a build needs only tsc.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/copy-protos.sh
rm -rf dist
node_modules/.bin/tsc -p tsconfig.json
mkdir -p dist/proto/compactd/v1
cp proto/compactd/v1/*.proto dist/proto/compactd/v1/
