#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, bring the lab up, test, and leave the lab
# as it was found (a lab this run brought up is taken down again, even when tests fail).
#   scripts/test.sh [pytest arguments]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
"$repo/scripts/setup.sh"
ft="$repo/.venv/bin/ft"

lab_was_up=false
if "$ft" lab status >/dev/null 2>&1; then
    lab_was_up=true
fi

teardown() {
    if [[ "$lab_was_up" == false ]]; then
        echo "[test] taking down the lab this run brought up"
        "$ft" lab down || echo "[test] warning: lab teardown failed" >&2
    fi
}
trap teardown EXIT

"$ft" lab up
# Lab tests fail (not skip) when the lab is missing: CI must never pass by skipping them.
FT_REQUIRE_LAB=1 "$repo/.venv/bin/python" -m pytest "$@"
