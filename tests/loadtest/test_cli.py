"""`orca simulate` end to end through loadtest.cli.main: report, capacity ratio, JSON and PNG."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest import targets
from loadtest.cli import add_bench_parsers, engine_config, main
from loadtest.cost_models import make_cost_model
from shared import env
from shared.config import CacheConfig, SchedulerConfig


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


def test_result_and_plot_folders_are_made_and_an_unwritable_one_is_refused_before_anything_runs(tmp_path, capsys):
    result, png = tmp_path / "out" / "bench" / "sim.json", tmp_path / "plots" / "sim.png"
    assert main(["simulate", "--cost-model", "gpt3-175b-a100-tp8pp2", "--num-prompts", "5", "--disable-tqdm",
                 "--save-result", str(result), "--plot", str(png)]) == 0
    assert json.loads(result.read_text())["runs"] and png.exists()

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    capsys.readouterr()
    assert main(["bench", "--transport", "nats", "--nats-url", "nats://127.0.0.1:1", "--num-prompts", "1",
                 "--save-result", str(blocker / "r.json")]) == 2, "refused before it tries to reach a server"
    assert "--save-result" in capsys.readouterr().err


def test_bad_values_are_one_line_errors(capsys):
    assert main(["simulate", "--request-rate", "0", "--num-prompts", "5"]) == 2
    assert main(["bench", "--transport", "nats", "--policy", "orca", "request-level"]) == 2
    assert "one policy" in capsys.readouterr().err


def test_parsers_register_on_another_command():
    parser = argparse.ArgumentParser(prog="orca")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--transport", "inprocess", "--sweep", "1,2"])
    assert args.func.__name__ == "cmd_bench" and args.sweep == "1,2"


@pytest.fixture
def no_engine_variables(monkeypatch):
    for var in env.engine_env_vars():
        monkeypatch.delenv(var.name, raising=False)


def test_bench_engine_flags_reach_the_engine_and_a_launched_server(tmp_path, monkeypatch, no_engine_variables):
    parser = argparse.ArgumentParser(prog="orca")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--launch", "--model", str(tmp_path), "--seed", "3", "--max-num-seqs", "32",
                              "--block-size", "1", "--enable-prefix-caching", "--no-async-scheduling", "-tp", "2"])
    config = engine_config(args, "paged:8")
    assert config.scheduler == SchedulerConfig(policy="paged", max_num_seqs=8, async_scheduling=False)
    assert config.cache == CacheConfig(block_size=1, enable_prefix_caching=True)
    assert config.model.seed == 0 and config.parallel.tensor_parallel_size == 2  # --seed seeds the workload

    launched = []

    def no_popen(cmd, **kwargs):
        launched.append(cmd)
        raise RuntimeError("not started")

    monkeypatch.setattr(targets.subprocess, "Popen", no_popen)
    with pytest.raises(RuntimeError, match="not started"), targets.launch_serve(config, threads=2):
        pass
    [cmd] = launched
    assert cmd[cmd.index("serve") + 3:] == ["--model", str(tmp_path), "--scheduler", "paged", "--max-num-seqs", "8",
                                            "--no-async-scheduling", "--block-size", "1", "--enable-prefix-caching",
                                            "--tensor-parallel-size", "2", "--worker-threads", "2"]


def test_simulate_takes_the_scheduler_and_cache_flags(monkeypatch, no_engine_variables):
    import loadtest.simulator

    seen, real = [], loadtest.simulator.simulate

    def spy(requests, arrivals, scheduler, cost_model, **kwargs):
        seen.append((scheduler, kwargs["cache"]))
        return real(requests, arrivals, scheduler, cost_model, **kwargs)

    monkeypatch.setattr(loadtest.simulator, "simulate", spy)
    assert main(["simulate", "--num-prompts", "4", "--policy", "orca:4", "--block-size", "1",
                 "--enable-chunked-prefill", "--no-async-scheduling", "--disable-tqdm"]) == 0
    [(scheduler, cache)] = seen
    assert scheduler == SchedulerConfig(max_num_seqs=4, enable_chunked_prefill=True, async_scheduling=False)
    kv_fits = make_cost_model("gpt3-175b-a100-tp8pp2").default_kv_cache_tokens
    assert cache == CacheConfig(kv_cache_tokens=kv_fits, block_size=1)


@pytest.mark.parametrize("environ,key", [({}, None), ({"ORCA_API_KEY": "orca"}, "orca"),
                                         ({"OPENAI_API_KEY": "openai", "ORCA_API_KEY": "orca"}, "openai")])
def test_bench_takes_the_api_key_from_the_environment_as_vllm_bench_serve_does(monkeypatch, environ, key):
    import argparse

    for name in ("OPENAI_API_KEY", "ORCA_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_bench_parsers(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench"]).api_key == key
    assert parser.parse_args(["bench", "--api-key", "flag"]).api_key == "flag"


def test_redrawn_runs_keep_their_own_workload_and_stay_apart(tmp_path, capsys):
    """`--load-result a.json b.json --plot`: the subtitle names the loaded runs' workloads (not this command
    line's defaults), and runs of one label that differ in workload are two curves, not one."""
    from loadtest.cli import _kept_apart, _loaded_runs, plot_titles

    paper, short = tmp_path / "paper.json", tmp_path / "short.json"
    common = ["simulate", "--cost-model", "gpt3-175b-a100-tp8pp2", "--num-prompts", "10", "--sweep", "5",
              "--policy", "orca", "--disable-tqdm"]
    assert main([*common, "--save-result", str(paper)]) == 0
    assert main([*common, "--dataset", "random", "--random-input-len", "32", "--random-output-len", "8",
                 "--save-result", str(short)]) == 0
    runs = _kept_apart(_loaded_runs([str(paper), str(short)]))
    assert [r["label"] for r in runs] == [f"orca ({r['workload']})" for r in runs] and len({r["label"] for r in runs}) == 2
    args = argparse.Namespace(dataset="orca-paper", burstiness=1.0, trace=None)
    _, subtitle = plot_titles(args, runs)
    assert "orca-paper workload" in subtitle and "random workload: input 32, output 8 tokens" in subtitle
    assert main(["bench", "--load-result", str(paper), str(short), "--latency-target", "100"]) == 0
    assert capsys.readouterr().out.count("orca (") >= 2
    # a baseline loaded beside a run measured now stays apart too
    assert main([*common, "--dataset", "random", "--random-input-len", "32", "--random-output-len", "8",
                 "--load-result", str(paper), "--latency-target", "100"]) == 0
    out = capsys.readouterr().out
    assert "orca (orca-paper workload" in out and "orca (random workload" in out
