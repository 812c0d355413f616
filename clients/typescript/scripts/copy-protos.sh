#!/usr/bin/env bash
# Copies the repository's .proto files into proto/ (when the package sits in the
# repository; a packed or installed copy already has them).
set -euo pipefail
cd "$(dirname "$0")/.."
src=../../proto/compactd/v1
if [ -d "$src" ]; then
  mkdir -p proto/compactd/v1
  cp "$src"/*.proto proto/compactd/v1/
fi
