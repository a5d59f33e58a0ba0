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

# What the lab tests look through, from Debian: a terminal for `ft status --watch` (tmux) and a
# browser for `ft report`'s page (Chromium's headless shell, no desktop recommended with it).
missing=()
command -v tmux >/dev/null || missing+=(tmux)
command -v chromium-headless-shell >/dev/null || missing+=(chromium-headless-shell)
if ((${#missing[@]})); then
    echo "[test] installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

lab_was_up=false
lab_release=22.05
if "$ft" lab status >/dev/null 2>&1; then
    lab_was_up=true
    lab_release="$("$ft" lab status --json | "$repo/.venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["slurm"] or "22.05")')"
fi
# The Slurm releases users run, beside Debian 12's 22.05: the Slurm-facing lab tests (marked
# slurm_matrix) run again on each, built once per machine from Debian's source package (about 5
# minutes; kept across purges). 26.05: Debian's archive lists it (sid) but serves no source tarball
# for it yet; FT_TEST_SLURM_RELEASES="24.11 26.05" asks for it. Empty: 22.05 alone.
read -r -a matrix_releases <<<"${FT_TEST_SLURM_RELEASES-24.11}"

unit_pid=""
# shellcheck disable=SC2317  # run by the EXIT trap
teardown() {
    if [[ -n "$unit_pid" ]]; then  # the unit tests this script started, when it is cut short
        kill "$unit_pid" 2>/dev/null || true
    fi
    if [[ "$lab_was_up" == false ]]; then
        echo "[test] taking down the lab this run brought up"
        "$ft" lab down || echo "[test] warning: lab teardown failed" >&2
    else
        "$ft" lab up --slurm "$lab_release" >/dev/null || echo "[test] warning: the lab's Slurm $lab_release is not back" >&2
        echo "[test] the lab was up before this run and stays up, on Slurm $lab_release (make down stops it)"
    fi
}
trap teardown EXIT

# The lab tests run as two streams (pytest-xdist workers), each in its own slice of the lab: four
# nodes with their own free/standard/premium partitions and ft profile (tests/conftest.py). A lab
# that was up keeps this shape afterwards (`ft lab up --nodes 4 --slices 1` gives it back its own).
lab_shape=(--nodes 8 --slices 2)
if [[ "${FT_TEST_KEEP_LAB:-0}" != 1 && -e "${FT_LAB_STATE_DIR:-/var/lib/ft-lab}" ]]; then
    echo "[test] purging the lab's state (FT_TEST_KEEP_LAB=1 keeps it)"
    purge_started=$SECONDS
    "$ft" lab down --purge
    "$ft" lab up --slurm 22.05 "${lab_shape[@]}"
    echo "[test] lab purged and up again in $((SECONDS - purge_started)) s"
else
    "$ft" lab up --slurm 22.05 "${lab_shape[@]}"
fi
# Lab tests fail (not skip) when the lab is missing: CI must never pass by skipping them.
export FT_REQUIRE_LAB=1
py="$repo/.venv/bin/python"
if [[ $# -gt 0 ]]; then
    "$py" -m pytest "$@"
    exit
fi
# The whole suite. The lab tests spend most of their time waiting on jobs, Slurm and the watchdog's
# clocks, so they run as two streams, one per lab slice, and the unit tests (no lab) beside them.
# First, alone, the tests that change what every lab test shares (marked whole_lab: the lab's size,
# its playbook, the model cache). Measured both ways: first, the lab's one-time costs (the first
# run's model build and compiled op) are paid while little else runs, and the whole suite was faster.
unit_log="$(mktemp /tmp/ft-unit-tests.XXXXXX)"
"$py" -m pytest -p no:cacheprovider tests/unit --basetemp="$(mktemp -d /tmp/ft-unit-basetemp.XXXXXX)" \
    >"$unit_log" 2>&1 &
unit_pid=$!
lab_status=0
"$py" -m pytest -m whole_lab tests/lab || lab_status=$?
"$py" -m pytest -m "not whole_lab" --numprocesses 2 --dist loadfile tests/lab || lab_status=$?
unit_status=0
wait "$unit_pid" || unit_status=$?
unit_pid=""
for release in "${matrix_releases[@]}"; do
    matrix_started=$SECONDS
    echo "[test] the Slurm-facing lab tests on Slurm $release (ft lab up --slurm $release)"
    if ! "$ft" lab up --slurm "$release" "${lab_shape[@]}"; then
        echo "[test] the lab did not come up on Slurm $release" >&2
        lab_status=1
        continue
    fi
    "$py" -m pytest -p no:cacheprovider -m "slurm_matrix and whole_lab" tests/lab || lab_status=$?
    "$py" -m pytest -p no:cacheprovider -m "slurm_matrix and not whole_lab" --numprocesses 2 --dist loadfile \
        tests/lab || lab_status=$?
    echo "[test] Slurm $release: $((SECONDS - matrix_started)) s"
done
echo "[test] the unit tests, run beside the lab tests (log: $unit_log):"
cat "$unit_log"
echo "[test] lab tests exit $lab_status, unit tests exit $unit_status"
exit $((lab_status != 0 ? lab_status : unit_status))
