#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, bring the lab up from purged state, test,
# and take down a lab this run brought up (even when tests fail).
#   scripts/test.sh [pytest arguments]
#
# A clean clone is not a fresh machine: the lab's state (/var/lib/ft-lab: models, caches, runs)
# outlives clones, and once hid a first-run failure. So the lab is purged first (its runs, models,
# caches, accounting): about 70 s, plus the first run's model build and compiled DeepSpeed op.
# FT_TEST_KEEP_LAB=1 skips the purge, for quick iterations on a lab you trust.
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
    else
        echo "[test] the lab was up before this run and stays up (make down stops it)"
    fi
}
trap teardown EXIT

if [[ "${FT_TEST_KEEP_LAB:-0}" != 1 && -e "${FT_LAB_STATE_DIR:-/var/lib/ft-lab}" ]]; then
    echo "[test] purging the lab's state (FT_TEST_KEEP_LAB=1 keeps it)"
    purge_started=$SECONDS
    "$ft" lab down --purge
    "$ft" lab up
    echo "[test] lab purged and up again in $((SECONDS - purge_started)) s"
else
    "$ft" lab up
fi
# Lab tests fail (not skip) when the lab is missing: CI must never pass by skipping them.
FT_REQUIRE_LAB=1 "$repo/.venv/bin/python" -m pytest "$@"
