"""Choosing the kernel implementation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca_kernels import backend
from orca_kernels.backend import KernelOps, get_kernel_ops

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_torch_and_auto_on_cpu():
    assert get_kernel_ops("torch", "cuda") is backend.TORCH_OPS
    assert get_kernel_ops("torch", "cpu") is backend.TORCH_OPS
    assert get_kernel_ops("auto", "mps") is backend.TORCH_OPS


@pytest.mark.skipif(not backend.attention_cpu.available(torch.float32), reason="no C compiler here")
def test_auto_on_cpu_is_the_compiled_attention_where_the_dtype_has_one():
    assert get_kernel_ops("auto", "cpu") is backend.CPU_OPS_FLOAT32  # float32: the C token ops too
    assert get_kernel_ops("auto", "cpu", fused_token_ops=False) is backend.CPU_OPS  # a compiled step's
    assert get_kernel_ops("cpu", "cpu", torch.float64) is backend.CPU_OPS  # float64: torch's, as transformers
    assert get_kernel_ops("auto", "cpu", torch.bfloat16) is backend.TORCH_OPS  # no bf16 C kernel: torch
    with pytest.raises(ValueError, match="float32/float64"):
        get_kernel_ops("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="runs on cpu"):
        get_kernel_ops("cpu", "cuda")


def test_cpu_attention_falls_back_to_torch_without_a_compiler():
    code = """
import shutil
shutil.which = lambda name: None  # no cc, gcc or clang
from orca_kernels.backend import TORCH_OPS, get_kernel_ops
assert get_kernel_ops("auto", "cpu") is TORCH_OPS
"""
    result = _run_python(code, {"ORCA_CACHE_DIR": "/nonexistent-orca-cache"})
    assert result.returncode == 0, result.stderr


@pytest.mark.triton
def test_triton_on_cuda_and_on_cpu_under_interpreter():
    assert get_kernel_ops("auto", "cuda") is backend.TRITON_OPS
    assert get_kernel_ops("triton", "cuda") is backend.TRITON_OPS
    assert get_kernel_ops("triton", "cpu") is backend.TRITON_OPS  # conftest set TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="runs on cuda"):
        get_kernel_ops("triton", "mps")


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        get_kernel_ops("cuda", "cuda")


def test_ops_are_frozen():
    ops = get_kernel_ops("torch", "cpu")
    assert isinstance(ops, KernelOps)
    with pytest.raises(AttributeError):
        ops.attention = None  # type: ignore[misc]


def _run_python(code: str, env_updates: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_updates}
    env.update({k: v for k, v in env_updates.items() if v is not None})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_torch_path_without_triton():
    """Every kernels module imports, and the torch ops work, on a machine without triton."""
    code = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import pytest
import torch
from orca_kernels.backend import get_kernel_ops
ops = get_kernel_ops("auto", "cuda")
assert ops.attention.__name__ == "ragged_attention_torch"
out, _ = ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
with pytest.raises(ValueError, match="not installed"):
    get_kernel_ops("triton", "cuda")
"""
    result = _run_python(code, {"TRITON_INTERPRET": None})
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(backend.attention.triton is None, reason="triton is not installed")
def test_triton_on_cpu_needs_interpreter():
    code = """
import pytest
from orca_kernels.backend import get_kernel_ops
with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
    get_kernel_ops("triton", "cpu")
"""
    result = _run_python(code, {"TRITON_INTERPRET": None})
    assert result.returncode == 0, result.stderr
