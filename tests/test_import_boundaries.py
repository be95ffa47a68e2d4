"""The control plane never imports torch or triton: `shared`, the pure cores and every control-plane
service module (the engine master's actor included, which starts the workers but runs no model), each
imported in a fresh interpreter."""

import subprocess
import sys

import pytest

CONTROL_PLANE = [
    "shared.config", "shared.messages", "shared.parallel", "shared.env", "core.scheduler", "core.kv_cache",
    "core.admission", "core.detokenize", "services.engine.master", "services.engine.actor",
    "services.engine.launch", "services.admission.service", "services.tokenizer.service",
    "services.jobs.service", "services.gateway.app", "services.serve",
]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_control_plane_module_imports_neither_torch_nor_triton(module):
    code = (f"import importlib, sys; importlib.import_module({module!r}); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} pulled in {out.stdout.strip()}"


def test_checking_a_constraint_imports_neither_torch_nor_triton():
    """The gateway and the NATS tokenizer check every schema, regex and grammar a user sends (llguidance)."""
    code = ("import sys; from shared.structured import StructuredOutputs as S; "
            "S(json={'type': 'object', 'properties': {'a': {'type': 'integer'}}}).validate(); "
            "S(regex='[a-z]+').validate(); S(grammar='start: \"x\"').validate(); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"checking a constraint pulled in {out.stdout.strip()}"
