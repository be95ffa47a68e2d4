"""The tokenizer service and the gateway load the checkpoint's tokenizer without torch
(`load_tokenizer(..., control_plane=True)`), and it is the same tokenizer a model process loads."""

import json
import subprocess
import sys

from tests.services.stack import ROOT

TEXTS = ["Hello world", "Héllo wörld ☃ 123", "  leading spaces\nand lines\t", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]

PROBE = """
import json, sys
if sys.argv[3] == "with-torch":
    import torch  # a model process: torch is there before the tokenizer loads
from engine.tokenizer import load_tokenizer
texts, messages = json.loads(sys.argv[2])
seen = {}
for model in sys.argv[1].split(","):
    tok = load_tokenizer(model, control_plane=sys.argv[3] == "control-plane")
    seen[model] = {
        "class": type(tok._tok).__name__,
        "ids": [tok.encode(t) for t in texts],
        "text": [tok.decode(tok.encode(t)) for t in texts],
        "chat": tok.apply_chat_template(messages) if tok.chat_template else None,
        "eos": tok.eos_token_id,
    }
print(json.dumps({"tokenizers": seen, "torch": "torch" in sys.modules}))
"""


def probe(models: list[str], mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(models), json.dumps([TEXTS, MESSAGES]), mode],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_the_control_plane_tokenizer_loads_no_torch_and_equals_the_model_process_one(demo_model, demo_gpt2):
    """The demo Llama (with a chat template) and GPT-2 (without one)."""
    models = [demo_model, demo_gpt2]
    control_plane, model_process = probe(models, "control-plane"), probe(models, "with-torch")
    assert (control_plane["torch"], model_process["torch"]) == (False, True)
    assert control_plane["tokenizers"] == model_process["tokenizers"]
