"""The tokenizer service and the gateway load the checkpoint's tokenizer without torch
(`load_tokenizer(..., control_plane=True)`), and it is the same tokenizer a model process loads."""

import json
import subprocess
import sys

import pytest

from tests.services.stack import ROOT

TEXTS = ["Hello world", "Héllo wörld ☃ 123", "  leading spaces\nand lines\t", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]

PROBE = """
import json, sys
if sys.argv[3] == "with-torch":
    import torch  # a model process: torch is there before the tokenizer loads
from engine.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1], control_plane=sys.argv[3] == "control-plane")
texts, messages = json.loads(sys.argv[2])
print(json.dumps({
    "class": type(tok._tok).__name__,
    "ids": [tok.encode(t) for t in texts],
    "text": [tok.decode(tok.encode(t)) for t in texts],
    "chat": tok.apply_chat_template(messages) if tok.chat_template else None,
    "eos": tok.eos_token_id,
    "torch": "torch" in sys.modules,
}))
"""


def probe(model: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, model, json.dumps([TEXTS, MESSAGES]), mode],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


@pytest.mark.parametrize("model", ["demo_model", "demo_gpt2"])
def test_the_control_plane_tokenizer_loads_no_torch_and_equals_the_model_process_one(model, request):
    path = request.getfixturevalue(model)
    control_plane, model_process = probe(path, "control-plane"), probe(path, "with-torch")
    assert control_plane.pop("torch") is False
    assert model_process.pop("torch") is True
    assert control_plane == model_process
