#!/usr/bin/env bash
# Tests of the Python client against the real compactd binary.
#
#   COMPACTD_BIN=target/debug/compactd clients/python/test.sh [pytest args]
#
# Makes a venv in clients/python/.venv (gitignored), installs the pinned build and test
# dependencies (constraints.txt) once, builds and installs the package from the
# repository's proto/ on every run, then runs pytest. COMPACTD_BIN defaults to the
# repository's target/debug/compactd, then target/release/compactd.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$here/.venv"
python="${PYTHON:-python3}"

run() { echo "+ $*" >&2; "$@"; }

if [[ -z "${COMPACTD_BIN:-}" ]]; then
    for build in debug release; do
        if [[ -x "$repo/target/$build/compactd" ]]; then COMPACTD_BIN="$repo/target/$build/compactd"; break; fi
    done
fi
if [[ -z "${COMPACTD_BIN:-}" || ! -x "$COMPACTD_BIN" ]]; then
    echo "clients/python/test.sh: no compactd binary; set COMPACTD_BIN or run cargo build" >&2
    exit 1
fi
export COMPACTD_BIN
echo "clients/python: testing against $COMPACTD_BIN" >&2

stamp="$venv/.deps-$(sha256sum "$here/constraints.txt" | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    rm -rf "$venv"
    run "$python" -m venv "$venv"
    run "$venv/bin/python" -m pip install --quiet -c "$here/constraints.txt" \
        grpcio grpcio-tools protobuf setuptools pytest httpx
    # The documented path once: an isolated build, as `pip install ./clients/python` does.
    run "$venv/bin/python" -m pip install --quiet -c "$here/constraints.txt" "$here"
    touch "$stamp"
fi
# Rebuild from the current protos and sources (no isolation: the pinned tools are here).
run "$venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall "$here"
rm -rf "$here/build"

cd "$here"
run "$venv/bin/python" -m pytest -p no:cacheprovider "$@" tests
