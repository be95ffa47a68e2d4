"""`orca simulate --policy orca request-level static:1`: per-policy batch sizes, the paper block."""

from __future__ import annotations

import json

import pytest

from loadtest.cli import main, parse_policy


def test_policy_items_carry_their_own_max_batch_size():
    assert parse_policy("static:8", 128) == ("static", 8)
    assert parse_policy("orca", 128) == ("orca", 128)
    for bad in ("fifo", "static:0", "static:x"):
        with pytest.raises(ValueError, match="--policy"):
            parse_policy(bad, 128)


def test_simulate_prints_the_papers_comparison_beside_its_own(tmp_path, capsys):
    result = tmp_path / "sim.json"
    code = main(["simulate", "--cost-model", "gpt3-175b-a100-tp8pp2", "--num-prompts", "30", "--sweep", "0.2,2,40",
                 "--policy", "orca", "request-level", "static:1", "--disable-tqdm", "--save-result", str(result)])
    assert code == 0
    out = capsys.readouterr().out
    assert "capacity ratio orca / static:1" in out
    assert "the Orca paper's GPT-3 175B comparison" in out and "36.9x" in out and "0.185 req/s" in out
    assert "split: static:1 -> request-level" in out
    saved = json.loads(result.read_text())
    assert {(r["policy"], r["label"]) for r in saved["runs"]} == {
        ("orca", "orca"), ("request-level", "request-level"), ("static", "static:1")}
    assert any("36.9x" in line for line in saved["capacity_ratios"])


def test_a_bad_policy_is_a_one_line_error(capsys):
    assert main(["simulate", "--num-prompts", "5", "--policy", "orca", "static:0"]) == 2
    assert "max batch size" in capsys.readouterr().err
