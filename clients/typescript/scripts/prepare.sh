#!/usr/bin/env bash
# npm's `prepare`: runs on `npm ci` / `npm install` here, and when another package installs
# this one by path (`npm install ../../clients/typescript`). In that last case npm does not
# install this package's devDependencies, so fetch them (pinned by package-lock.json) first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x node_modules/.bin/tsc ]; then
  # Inside another install npm sets npm_config_* for that project, and NODE_ENV=production
  # under `npm install --omit=dev`: use this one's defaults, with its build tools.
  env -u NODE_ENV $(env | grep -o '^npm_config_[A-Za-z_]*' | sed 's/^/-u /') \
    npm ci --include=dev --ignore-scripts --no-audit --no-fund --loglevel=error
fi
bash scripts/build.sh
