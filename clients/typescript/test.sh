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

echo "== tests (node $(node --version))"
timeout 600 npm test

# OpenCode plugins run in Bun: run the same compiled tests there too when a bun is at hand
# ($BUN, or bun on PATH; `npm install bun` brings one).
BUN_BIN="${BUN:-$(command -v bun || true)}"
if [ -n "$BUN_BIN" ]; then
  echo "== tests (bun $("$BUN_BIN" --version))"
  timeout 600 "$BUN_BIN" test --timeout 60000 ./.test-build/test/*.test.js
else
  echo "== tests under bun: skipped (no bun on PATH and \$BUN unset)"
fi
