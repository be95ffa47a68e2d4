"""This project's `kernels` package and Hugging Face's `kernels` distribution share an import name.
transformers 5.25 requires the latter and imports it (`from kernels import CUDAProperties`): from the
repository root, ours answers and the import fails. pyproject.toml keeps transformers below 5.25
until ours is renamed; this test says so at once if an upgrade brings the clash back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_imports_its_kernels_integration_from_the_repository_root():
    probe = ("import importlib.metadata as m\n"
             "import transformers.integrations.hub_kernels\n"
             "print(m.version('transformers'))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
