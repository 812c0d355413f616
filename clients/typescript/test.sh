#!/usr/bin/env bash
# The TypeScript client's checks: install from the pinned lockfile, check that the committed
# generated code matches proto/, build, then run the tests against the real compactd binary
# ($COMPACTD_BIN, else the repository's target/debug or target/release build).
set -euo pipefail
cd "$(dirname "$0")"
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false

echo "== npm ci"
npm ci --no-progress

echo "== generated code matches proto/"
bash scripts/gen.sh
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if ! git diff --exit-code --stat -- src/gen; then
    echo "src/gen/ is stale: run 'npm run gen' in clients/typescript and commit the result" >&2
    exit 1
  fi
fi

echo "== build"
bash scripts/build.sh

echo "== tests"
npm test
