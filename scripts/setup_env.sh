#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install wrapopt.
#
# torch comes first, chosen for the machine:
#   * an interpreter that already has torch (the user's own CUDA or ROCm build):
#     the venv sees it through --system-site-packages and pip leaves it alone;
#   * a GPU (nvidia-smi answers): pip's default torch wheel, which is a CUDA build;
#   * no GPU: the CPU build (torch==$WRAPOPT_CPU_TORCH, default 2.13.0, which pip
#     finds on disk here; elsewhere set PIP_EXTRA_INDEX_URL to a CPU wheel index).
# A second run finds the stamp file and only reinstalls wrapopt if pyproject.toml changed.
#
# pip installs without byte-compiling (--no-compile: compiling every module of torch, transformers and
# the rest took about 60 of setup's 100 s of CPU here); the modules a run imports are compiled on first
# use instead, and one import of wrapopt's API and FSDP2 here compiles those with the bytecode cache on
# (Python writes no cache where PYTHONDONTWRITEBYTECODE is set, as on the VM this was measured on).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev,plot,hf,fast,db,progress,float8}  # float8: torchao, which requires nothing (no CUDA torch)
CPU_TORCH=${WRAPOPT_CPU_TORCH:-2.13.0}
stamp="$VENV/.wrapopt-installed"
want="$(cat pyproject.toml | sha1sum | cut -c1-12) extras=$EXTRAS"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: $PY already has torch $("$PY" -c 'import torch; print(torch.__version__)'); the venv reuses it" >&2
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
pip="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found; installing the default (CUDA) torch build" >&2
    $pip install -q --no-compile "torch>=2.6"
  else
    echo "setup: no GPU; installing the CPU build torch==$CPU_TORCH" >&2
    $pip install -q --no-compile "torch==$CPU_TORCH"
    "$VENV/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'setup: got a CUDA torch build on a machine without a GPU; set PIP_EXTRA_INDEX_URL to a CPU wheel index')"
  fi
fi
$pip install -q --no-compile -e ".[$EXTRAS]" 2> >(grep -v "is ignored: it is neither" >&2)
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -W ignore -c "import wrapopt.api, torch.distributed.fsdp, optuna"
echo "$want" > "$stamp"
