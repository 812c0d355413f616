#!/usr/bin/env bash
# The OpenCode plugin's tests: builds the plugin, then runs the real OpenCode (opencode-ai
# from npm, headless) with it against a scripted OpenAI-compatible endpoint, and the same
# session with no plugin and with DCP for the comparison table.
#
#   COMPACTD_BIN=/path/to/compactd bash integrations/opencode/test.sh
#
# COMPACTD_BIN defaults to the repository's target/debug/compactd. Skips (exit 0, SKIPPED)
# only when the npm registry is unreachable: OpenCode, DCP and the provider package OpenCode
# loads at run time all come from it.
set -euo pipefail
cd "$(dirname "$0")"
start=$SECONDS

if ! timeout 20 npm ping --fetch-retries=0 --fetch-timeout=10000 --loglevel=silent >/dev/null 2>&1; then
  echo "SKIPPED: the npm registry is unreachable (npm ping failed); the OpenCode end-to-end test needs opencode-ai from npm"
  exit 0
fi

COMPACTD_BIN=${COMPACTD_BIN:-../../target/debug/compactd}
if [ ! -x "$COMPACTD_BIN" ]; then
  echo "COMPACTD_BIN=$COMPACTD_BIN is not an executable (build compactd first)" >&2
  exit 1
fi
export COMPACTD_BIN=$(cd "$(dirname "$COMPACTD_BIN")" && pwd)/$(basename "$COMPACTD_BIN")

# Install only when the lockfile changed since the last install (OpenCode's platform
# binaries are ~200 MB; a fresh `npm ci` every run would dominate the test's time).
stamp=node_modules/.compactd-lock-stamp
if [ ! -f "$stamp" ] || ! cmp -s package-lock.json "$stamp" || [ ! -e node_modules/@compactd/client ]; then
  # `npm install`, not `npm ci`: npm 11 leaves the other platforms' optional packages
  # (opencode-darwin-arm64, ...) out of the lockfile and `npm ci` then refuses it as out of
  # sync. `npm install` installs from the lockfile as committed and leaves it unchanged.
  npm install --no-audit --no-fund --loglevel=error
  cp package-lock.json "$stamp"
fi
# The TypeScript client is linked by path (file:../../clients/typescript): build it from
# its current sources (its prepare installs its own pinned devDependencies if needed).
bash ../../clients/typescript/scripts/prepare.sh
npm run --silent build

node --test --test-concurrency=1 --test-reporter=spec test/convert.test.mjs test/mirror.test.mjs test/sidecar.test.mjs test/e2e.test.mjs
echo "integrations/opencode: passed in $((SECONDS - start))s"
