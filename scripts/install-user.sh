#!/usr/bin/env bash
# Install ft for yourself on a cluster's login node, without root: a venv with ft and its login-node
# dependencies only (no torch: the login node never trains), and `ft` in ~/.local/bin.
#
#   scripts/install-user.sh
#
# Then, once per cluster:  ft cluster add NAME   (a profile from what the login node discovers)
#                          ft cluster prepare NAME   (the compute nodes' training environment)
#                          ft doctor --cluster NAME
# Settings: FT_PYTHON (default python3, 3.11 or newer), FT_HOME (default ~/.local/share/ft),
# FT_BIN_DIR (default ~/.local/bin). pip's own variables (PIP_INDEX_URL, PIP_FIND_LINKS) apply.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
home="${FT_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/ft}"
venv="$home/venv"
bin_dir="${FT_BIN_DIR:-$HOME/.local/bin}"
python="${FT_PYTHON:-python3}"

log() { printf '\033[1m[ft install]\033[0m %s\n' "$*"; }
fail() { printf '\033[1;31m[ft install] error:\033[0m %s\n' "$1" >&2; [ -z "${2:-}" ] || printf '  fix: %s\n' "$2" >&2; exit 1; }

if [ "$(id -u)" -eq 0 ]; then
    log "note: running as root; for the local lab as its administrator, scripts/setup.sh is the one"
fi
command -v "$python" >/dev/null || fail "$python is not on your PATH" \
    "load a Python 3.11+ (e.g. \`module load python/3.11\`) or set FT_PYTHON=/path/to/python3.11"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail \
    "$python is $("$python" -c 'import platform; print(platform.python_version())'); ft needs 3.11 or newer" \
    "load a newer Python (e.g. \`module load python/3.11\`) or set FT_PYTHON"
"$python" -c 'import ensurepip, venv' 2>/dev/null || fail "$python cannot make virtual environments (no ensurepip)" \
    "use a Python with venv support (a module, conda, or uv's python); Debian/Ubuntu admins: python3-venv"

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv"
    mkdir -p "$home"
    "$python" -m venv "$venv"
fi
# A current pip: the venv's own may be old (Debian 12's: 23.0, without `wheel`), and one that old
# fails to build some source packages ft cluster prepare gathers (deepspeed's).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
log "installing ft (login node: no training stack) from $repo"
# Editable: a `git pull` of the checkout updates ft; `ft doctor` then says when the compute nodes'
# environment is older than it (ft cluster prepare builds a new one).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$repo/constraints.txt" -e "$repo"

mkdir -p "$bin_dir"
ln -sfn "$venv/bin/ft" "$bin_dir/ft"
log "ft is $bin_dir/ft ($("$bin_dir/ft" --version))"
case ":$PATH:" in
    *":$bin_dir:"*) ;;
    *) log "add it to your PATH: echo 'export PATH=\"$bin_dir:\$PATH\"' >> ~/.bashrc; export PATH=\"$bin_dir:\$PATH\"" ;;
esac
log "next: ft cluster add NAME, ft cluster prepare NAME, ft doctor --cluster NAME"
