"""Hugging Face's `kernels` distribution owns the import name `kernels`: transformers >= 5.25 requires it
and imports it (`from kernels import CUDAProperties`). This project's kernels are the `orca_kernels`
package in kernels/orca_kernels, and kernels/ itself is no package, so from the repository root (where
pytest and the services run) `kernels` is never ours."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_imports_its_kernels_integration_from_the_repository_root():
    probe = "import transformers.integrations.hub_kernels\n"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_name_kernels_is_not_this_project_s_package_from_the_repository_root():
    """At most a namespace portion (kernels/ has no __init__.py), which any installed `kernels` outranks."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    probe = ("import importlib.util\n"
             "spec = importlib.util.find_spec('kernels')\n"
             f"print(spec is None or spec.origin is None or not spec.origin.startswith({str(ROOT / 'kernels')!r}))\n"
             "print(importlib.util.find_spec('orca_kernels').origin)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    not_ours, origin = done.stdout.split()
    assert not_ours == "True" and origin == str(ROOT / "kernels" / "orca_kernels" / "__init__.py")
