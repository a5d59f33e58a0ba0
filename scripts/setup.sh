#!/usr/bin/env bash
# Install what ft needs on this machine: the Python venv with pinned dependencies.
# System packages (Slurm, munge, MariaDB) are installed by ft's own Ansible roles (`ft lab up`),
# so the same roles are exercised here as on a real cluster.
#
#   scripts/setup.sh                  ft, the training stack (torch pinned to 2.13.0) and test tools
#   FT_EXTRAS=dev scripts/setup.sh    a login node: no training stack
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FT_VENV:-$repo/.venv}"
extras="${FT_EXTRAS:-dev,train}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# Debian's python3 needs python3-venv for `-m venv`; pyenv builds have it already.
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    log "installing python3-venv"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi

# Test tools from Debian (shellcheck lints the job scripts ft renders and ships).
if [[ "$extras" == *dev* ]] && ! command -v shellcheck >/dev/null; then
    log "installing shellcheck"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck
fi

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv"
    python3 -m venv "$venv"
fi

stamp="$venv/.ft-installed"
wanted="$(cat "$repo/constraints.txt" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1) $extras"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
    log "venv up to date ($venv)"
else
    log "installing ft[$extras] into $venv (pinned by constraints.txt)"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # DS_BUILD_OPS=0: DeepSpeed compiles its ops on first use (cached), not at install time.
    DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --quiet -c "$repo/constraints.txt" -e "${repo}[${extras}]"
    printf '%s' "$wanted" > "$stamp"
fi
log "ft is $venv/bin/ft"
