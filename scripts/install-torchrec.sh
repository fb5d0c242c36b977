#!/usr/bin/env bash
# Install TorchRec into the project's venv for tests/test_nn_torchrec.py (optional: without it those
# tests skip). torchrec's wheel depends on "fbgemm-gpu", the CUDA build of FBGEMM, which pip would
# fetch with a CUDA torch of its own; on a CPU torch the right FBGEMM is the "fbgemm-gpu-cpu" wheel.
# So torchrec and fbgemm-gpu-cpu go in with --no-deps (pinned: the pair known to import and pass
# against the CPU torch ./dev installs, torch 2.13), and their pure-Python dependencies come from
# embcache's "torchrec" extra. If `import torchrec` fails afterwards, this removes both again
# (so the tests skip instead of failing on a half-working import) and says so; it never fails ./dev.
# On a CUDA torch it installs nothing: pick the fbgemm-gpu/torchrec builds matching that torch by hand
# (https://pytorch.org/FBGEMM/fbgemm_gpu/installation.html). Idempotent; tries once per torch version
# (delete .venv/.embcache-torchrec-tried to try again).
# Usage: scripts/install-torchrec.sh
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${EMBCACHE_VENV:-.venv}"
py="$venv/bin/python"
TORCHREC_VERSION="${EMBCACHE_TORCHREC_VERSION:-1.8.0}"

# installed already (find_spec: importing torchrec takes seconds), or an earlier try with this torch failed
if "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchrec') is None)" 2>/dev/null; then
    exit 0
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)')
tried="$venv/.embcache-torchrec-tried"
if [ -f "$tried" ] && [ "$(cat "$tried")" = "$torch_version" ]; then
    exit 0
fi
echo "$torch_version" > "$tried"
if [ "$("$py" -c 'import torch; print(torch.version.cuda is None)')" != "True" ]; then
    echo "install-torchrec: torch is a CUDA build; install a matching torchrec and fbgemm-gpu by hand (tests skip)"
    exit 0
fi
if "$py" -m pip install -q -e ".[torchrec]" \
   && "$py" -m pip install -q --no-deps "torchrec==$TORCHREC_VERSION" "fbgemm-gpu-cpu==$TORCHREC_VERSION" \
   && "$py" -c "import torchrec; from torchrec.models.dlrm import DLRM" >/dev/null 2>&1; then
    echo "install-torchrec: torchrec $TORCHREC_VERSION (fbgemm-gpu-cpu) installed"
else
    echo "install-torchrec: torchrec $TORCHREC_VERSION does not install or import here; removing it (its tests skip)"
    "$py" -m pip uninstall -q -y torchrec fbgemm-gpu-cpu >/dev/null 2>&1 || true
fi
exit 0
