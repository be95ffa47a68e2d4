"""`orca simulate` end to end through bench.cli.main: report, capacity ratio, JSON and PNG."""

from __future__ import annotations

import argparse
import json

from bench.cli import add_bench_parsers, main


def test_simulate_sweep_saves_capacities_and_plots(tmp_path, capsys):
    result, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(["simulate", "--cost-model", "gpt3-175b-a100-tp8pp2", "--num-prompts", "40", "--sweep", "5,60",
                 "--policy", "orca", "request-level", "--goodput", "ttft:2000", "--disable-tqdm",
                 "--save-result", str(result), "--plot", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert "capacity at 190 ms/token" in out and "capacity ratio orca / request-level" in out
    saved = json.loads(result.read_text())
    assert {r["policy"] for r in saved["runs"]} == {"orca", "request-level"} and len(saved["runs"]) == 4
    assert saved["latency_target_ms"] == 190 and set(saved["capacity"]) == {"orca", "request-level"}
    assert all("request_goodput" in r["metrics"] for r in saved["runs"])
    assert png.stat().st_size > 10_000

    # re-plot from the saved file alone, at another target
    again = tmp_path / "again.png"
    assert main(["bench", "--load-result", str(result), "--latency-target", "100", "--plot", str(again)]) == 0
    assert "capacity at 100 ms/token" in capsys.readouterr().out and again.exists()


def test_bad_values_are_one_line_errors(capsys):
    assert main(["simulate", "--request-rate", "0", "--num-prompts", "5"]) == 2
    assert main(["bench", "--transport", "nats", "--policy", "orca", "request-level"]) == 2
    assert "one policy" in capsys.readouterr().err


def test_parsers_register_on_another_command():
    parser = argparse.ArgumentParser(prog="orca")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--transport", "inprocess", "--sweep", "1,2"])
    assert args.func.__name__ == "cmd_bench" and args.sweep == "1,2"
