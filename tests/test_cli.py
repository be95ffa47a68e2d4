"""What a user does first: make the demo model, load it with transformers, run `orca generate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def orca(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_demo_model_is_a_normal_hugging_face_checkpoint(demo_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    assert 3e6 < sum(p.numel() for p in model.parameters()) < 10e6  # "a few million"
    ids = tokenizer.encode("def main(): return 'ünïcødé'")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def main(): return 'ünïcødé'"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False).endswith("<|im_start|>assistant\n")


def test_generate_serves_every_good_line_and_names_every_bad_one(demo_model, tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": "def main():", "max_tokens": 5, "temperature": 0}),
        "{not json",
        json.dumps({"id": "b", "prompt_token_ids": [5] * 2000, "max_tokens": 5}),
        json.dumps({"id": "c", "prompt": "x", "top_p": 7}),
        "",
        json.dumps({"id": "d", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                    "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}),
        json.dumps({"id": "a", "prompt": "duplicate id", "max_tokens": 2}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = orca("generate", "--model", demo_model, "--input", str(source), "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", None, "b", "c", "d", "a"]
    assert records[0]["finish_reason"] == "length" and len(records[0]["token_ids"]) == 5
    assert set(records[0]["metrics"]) == {"queue_s", "ttft_s", "latency_s"}
    assert records[1]["error"].startswith("line 2: malformed JSON")
    assert records[2]["finish_reason"] == "error" and "line 3" in records[2]["error"] and "context" in records[2]["error"]
    assert "top_p" in records[3]["error"] and "line 4" in records[3]["error"]
    assert len(records[4]["logprobs"]) == 3 and len(records[4]["logprobs"][0]["top_logprobs"]) == 2
    prompt = records[4]["prompt_token_ids"]
    assert [lp["token_id"] for lp in records[4]["prompt_logprobs"]] == prompt[1:]
    assert all(len(lp["top_logprobs"]) == 1 for lp in records[4]["prompt_logprobs"])
    assert "prompt_logprobs" not in records[0]
    assert "already in use" in records[5]["error"] and "line 7" in records[5]["error"]
    assert "requests:" in result.stderr  # progress bar
    assert "6 requests, 4 errors" in result.stderr


def test_generate_with_a_bad_flag_says_so_without_a_traceback(demo_model, tmp_path):
    result = orca("generate", "--model", demo_model, "--input", "-", "--output", "-", "--max-model-len", "99999",
                  stdin="")
    assert result.returncode == 2
    assert "max_model_len=99999 exceeds the model's context of 1024" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_refuses_files_it_cannot_use_before_it_loads_the_model(demo_model, tmp_path):
    missing = orca("generate", "--model", demo_model, "--input", str(tmp_path / "nope.jsonl"), "--output", "-")
    unwritable = orca("generate", "--model", demo_model, "--input", "-", "--output", str(tmp_path / "no" / "out.jsonl"),
                      stdin="")
    assert missing.returncode == unwritable.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"orca: error: --input {tmp_path / 'nope.jsonl'}: No such file or directory"]
    assert unwritable.stderr.strip().splitlines() == [
        f"orca: error: --output {tmp_path / 'no' / 'out.jsonl'}: No such file or directory"]


def test_make_demo_model_where_it_cannot_write_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = orca("make-demo-model", str(blocker / "demo"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"orca: error: cannot write a checkpoint to {blocker / 'demo'}")
    assert "Traceback" not in result.stderr
