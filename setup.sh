#!/usr/bin/env bash
# Set up gradflow in ./.venv. Installs the CPU build of torch unless an NVIDIA GPU is present (an
# unpinned `pip install torch` on Linux pulls a multi-GB CUDA build). A torch wheel that pip can
# find locally (its find-links or wheelhouse, e.g. on an offline cluster) is used first. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch==2.13.0"
  elif pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    pip install -q "torch==2.13.0"  # the local wheel is in place: its dependencies from the usual index
  else
    # no local wheel (pip's find-links / wheelhouse): the CPU build from PyTorch's CPU index
    pip install -q "torch==2.13.0" --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
# gradflow and its companion gradflow-models (the embedded models beyond the core pair), both editable, so every
# embedded model loads by name (packages/gradflow-models: the models the core wheel leaves out)
pip install -q -e ".[test,explore,docs]" -e packages/gradflow-models
python -c "import torch, gradflow, gradflow_models; print(f'gradflow {gradflow.__version__} ready with gradflow-models \
{gradflow_models.__version__} (torch {torch.__version__}, cuda={torch.cuda.is_available()})')"
