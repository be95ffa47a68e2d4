"""`orca bench` (measure a server or the engine under load) and `orca simulate` (replay the same
load through the real scheduler with a cost model). Flags follow `vllm bench serve`'s names.

`--policy` takes scheduler policies (orca, request-level, paged, static), each optionally with its
own max batch size, `NAME:N` (the paper's `orca(max_bs)` and FasterTransformer's `ft(max_bs, mbs)`
curves: `--policy orca static:1 static:8`); otherwise `--max-num-seqs` applies.

The in-process engine and a `--launch`ed server take every engine flag of `orca serve` (generated
from shared/config.py by shared/flags.py) but `--scheduler`, which `--policy` replaces, and the
engine's `--seed` (here `--seed` seeds the workload). `orca simulate` takes the scheduler and
cache flags, so the simulated scheduler is configured as the engine's is.

`add_bench_parsers(subparsers)` registers both on the `orca` command; `python -m loadtest.cli`
runs them alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import uuid
from pathlib import Path

import msgspec

from loadtest.arrivals import arrival_times, parse_rate, parse_rates
from loadtest.datasets import DATASETS, load_dataset, load_trace, parse_range, with_token_ids
from loadtest.loadgen import RunResult, drive_stepped, drive_streaming
from loadtest.report import (Capacity, capacity_at, capacity_ratio, format_report, orca_counterpart, parse_goodput,
                          summarize)
from shared import env
from shared.api import GenerateRequest
from shared.config import EngineConfig, engine_fields
from shared.flags import add_engine_args, engine_config_from_args, section_from_args

TRANSPORTS = ("http", "nats", "inprocess")
PAPER_TARGET_MS = 190.0
"""The Orca paper's latency level for its GPT-3 175B comparison (36.9x)."""
AUTO_TARGET_FACTOR = 3.0
BENCH_ENGINE_FIELDS = [f.name for f in engine_fields() if f.name not in ("policy", "seed")]
"""`orca bench`'s engine flags: all but --scheduler (--policy) and the engine's --seed (--seed seeds the workload)."""
SIM_ENGINE_FIELDS = [f.name for f in engine_fields() if f.section in ("scheduler", "cache") and f.name != "policy"]
"""`orca simulate`'s: the scheduler's (but --scheduler) and the KV cache's."""


# ---- arguments ----------------------------------------------------------------------------

def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="orca-paper", choices=DATASETS,
                   help="orca-paper: input U[32,512], output U[1,128], EOS ignored; random: --random-*-len; "
                        "jsonl: --dataset-path in the `orca generate` input format")
    g.add_argument("--dataset-path", help="JSONL prompts for --dataset jsonl")
    g.add_argument("--random-input-len", default="32:512", help="N or LO:HI tokens (uniform) for --dataset random")
    g.add_argument("--random-output-len", default="1:128", help="N or LO:HI tokens (uniform) for --dataset random")
    g.add_argument("--vocab-size", type=int, default=4096, help="random prompt token ids are drawn below this")
    g.add_argument("--num-prompts", type=int, default=200, help="requests per run (per rate, per policy)")
    g.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts and arrivals")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", default="inf", help="requests/s (Poisson), or inf: all at once")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 = Poisson, <1 burstier, >1 smoother")
    a.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a.add_argument("--sweep", default=None, help="comma list of request rates, run in increasing order "
                                                  "(overrides --request-rate), e.g. 0.5,1,2,4,inf")
    a.add_argument("--policy", nargs="+", default=["orca"],
                   help="scheduler policies to measure (orca, request-level, paged, static), each as NAME or NAME:N "
                        "with N its own max batch size (e.g. static:8); for a running server, its label")
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:9000")
    r.add_argument("--latency-target", type=float, default=None,
                   help="ms/token at which to compare capacities (default: 190 for the GPT-3 model, else "
                        f"{AUTO_TARGET_FACTOR:g}x the lowest median normalized latency measured)")
    r.add_argument("--save-result", metavar="FILE.json", help="write config, metrics and capacities as JSON")
    r.add_argument("--save-detailed", action="store_true", help="also save every request's timings")
    r.add_argument("--load-result", nargs="+", metavar="FILE.json", default=[],
                   help="add the runs of earlier --save-result files to the summary and the plot")
    r.add_argument("--plot", metavar="FILE.png", help="draw median normalized latency vs throughput, per policy")
    r.add_argument("--label", default=None, help="name this invocation's curves 'POLICY (LABEL)' (to tell them "
                                                 "from --load-result curves of the same policy)")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_parsers(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="load-test orca serve (HTTP or NATS) or the engine in process",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="http (default): OpenAI /v1/completions; nats: orca.v1.generate; inprocess: LLMEngine")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="HTTP gateway URL")
    bench.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    bench.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or env.api_key(),
                       help="bearer token for the HTTP gateway (default: $OPENAI_API_KEY, as vllm bench serve reads "
                            "it, else $ORCA_API_KEY, the server's own)")
    bench.add_argument("--launch", action="store_true",
                       help="start `orca serve --scheduler POLICY` for each --policy on free ports, then stop it")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads of the in-process engine (or --worker-threads of a launched serve)")
    bench.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    add_workload_args(bench)
    add_engine_args(bench, BENCH_ENGINE_FIELDS, defaults={"model": None}, title="engine (in process or launched)",
                    helps={"model": "inprocess/--launch: checkpoint directory (default: the demo model); "
                                    "http: served name"})
    bench.set_defaults(func=cmd_bench)

    sim = subparsers.add_parser("simulate", help="replay a workload through the real scheduler with a cost model",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--cost-model", default="gpt3-175b-a100-tp8pp2",
                     choices=("this-machine", "gpt3-175b-a100-tp8pp2"), help="iteration-time model")
    sim.add_argument("--trace", metavar="FILE", help="JSONL of arrival_s, prompt_len, output_len (replaces the "
                                                     "dataset and arrival options)")
    sim.add_argument("--model", default=None, help="tokenizer directory for text prompts of --dataset jsonl")
    sim.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (GPT-3 model; default 8)")
    sim.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (GPT-3 model; default 2)")
    sim.add_argument("--max-model-len", type=int, default=None, help="context length (default: the cost model's)")
    add_workload_args(sim)
    add_engine_args(sim, SIM_ENGINE_FIELDS, defaults={"kv_cache_tokens": None}, title="engine (simulated)",
                    helps={"kv_cache_tokens": "KV cache capacity in token slots (default: what the cost model "
                                              "says fits)"})
    sim.set_defaults(func=cmd_simulate)


# ---- workloads --------------------------------------------------------------------------------

def workload(args: argparse.Namespace) -> list[GenerateRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} must be >= 1")
    return load_dataset(args.dataset, args.num_prompts, seed=args.seed, vocab_size=args.vocab_size,
                        path=args.dataset_path, input_range=parse_range(args.random_input_len),
                        output_range=parse_range(args.random_output_len))


def rates_of(args: argparse.Namespace) -> list[float]:
    return parse_rates(args.sweep) if args.sweep else [parse_rate(args.request_rate)]


def tagged(requests: list[GenerateRequest]) -> list[GenerateRequest]:
    """Fresh ids for one run (unique across runs, valid NATS subject tokens)."""
    tag = uuid.uuid4().hex[:8]
    return [msgspec.structs.replace(r, id=f"b{tag}-{i}") for i, r in enumerate(requests)]


def parse_policy(spec: str, max_num_seqs: int) -> tuple[str, int]:
    """'static:8' -> ('static', 8); 'orca' -> ('orca', max_num_seqs). ValueError if not a policy."""
    from core.policies import POLICIES

    name, colon, size = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"--policy {spec!r}: {name!r} is not one of {sorted(POLICIES)}")
    if not colon:
        return name, max_num_seqs
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"--policy {spec!r}: the max batch size after ':' must be an integer >= 1")
    return name, int(size)


def run_record(spec: str, rate: float, args: argparse.Namespace, result: RunResult,
               goodput: dict[str, float], extra: dict | None = None) -> dict:
    """`spec` is the --policy item ('static:8'): its policy name is saved as `policy`, the whole
    item (and --label) as the curve's `label`."""
    metrics = summarize(result.records, result.duration_s, goodput)
    title = f"{spec} @ {_rate_text(rate)} req/s"
    print(format_report(metrics, title, goodput), flush=True)
    run = {"policy": spec.partition(":")[0], "label": f"{spec} ({args.label})" if args.label else spec,
           "request_rate": _rate_text(rate), "burstiness": args.burstiness, "workload": workload_text(vars(args)),
           "max_concurrency": args.max_concurrency, "num_prompts": len(result.records), "metrics": metrics,
           **(extra or {})}
    if args.save_detailed:
        run["requests"] = [r.to_json(result.t0) for r in result.records]
    return run


def workload_text(config: dict) -> str:
    """The workload a run's flags (or a saved file's `config`) describe, for plots and tables."""
    if config.get("trace"):
        return f"trace {config['trace']}"
    dataset = config.get("dataset", "orca-paper")
    if dataset == "orca-paper":
        return "orca-paper workload: input U[32,512], output U[1,128], EOS ignored"
    if dataset == "random":
        return (f"random workload: input {config.get('random_input_len')}, "
                f"output {config.get('random_output_len')} tokens")
    return f"{dataset} workload {config.get('dataset_path') or ''}".strip()


def _loaded_runs(paths: list[str]) -> list[dict]:
    """The runs of saved files, each knowing its workload (older files keep it only in their config)."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        runs += [{"workload": workload_text(saved.get("config", {})), **run} for run in saved["runs"]]
    return runs


def _kept_apart(runs: list[dict]) -> list[dict]:
    """Runs of one curve label that differ in transport or workload (loaded, measured now, or both), each
    relabelled with what tells it apart: they merged into one curve with one capacity."""
    kinds: dict[str, set] = {}
    for run in runs:
        kinds.setdefault(_label(run), set()).add((run.get("transport"), run.get("workload")))
    for run in runs:
        kind = kinds[_label(run)]
        if len(kind) > 1:
            differs = [i for i in (0, 1) if len({k[i] for k in kind}) > 1]
            apart = ", ".join(str((run.get("transport"), run.get("workload"))[i]) for i in differs)
            run["label"] = f"{_label(run)} ({apart})"
    return runs


def _rate_text(rate: float | None) -> str:
    if rate is None:
        return "trace"
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- orca bench ----------------------------------------------------------------------------

def prepare_outputs(args: argparse.Namespace) -> None:
    """Make the folders of --save-result and --plot now, and refuse one that cannot be written before
    anything runs: a benchmark of minutes must not end in a FileNotFoundError that loses its results."""
    for flag, path in (("--save-result", args.save_result), ("--plot", args.plot)):
        if not path:
            continue
        folder = Path(path).resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot make its folder ({exc.strerror})") from None
        if not os.access(folder, os.W_OK):
            raise ValueError(f"{flag} {path}: its folder {folder} is not writable")


def cmd_bench(args: argparse.Namespace) -> int:
    prepare_outputs(args)
    if args.transport is None and args.load_result and not args.sweep:
        return finish(args, [], "orca bench")  # re-summarize / re-plot saved results only
    transport = args.transport or "http"
    if transport != "inprocess" and len(args.policy) > 1 and not args.launch:
        raise ValueError("a running server has one policy: give one --policy label per run (merge runs with "
                         "--load-result), or --launch to start `orca serve` once per policy")
    requests, rates, goodput = workload(args), rates_of(args), parse_goodput(args.goodput)
    if transport == "inprocess" or args.launch:
        for spec in args.policy:
            parse_policy(spec, args.max_num_seqs)  # refuse a bad one before running anything
    runs = []
    for policy in args.policy:
        if transport == "inprocess":
            runs += bench_inprocess(args, policy, requests, rates, goodput)
        elif args.launch:
            from loadtest.targets import launch_serve

            with launch_serve(engine_config(args, policy), args.threads) as (http_url, nats_url):
                args.base_url, args.nats_url = http_url, nats_url
                runs += asyncio.run(bench_streaming(args, transport, policy, requests, rates, goodput))
        else:
            runs += asyncio.run(bench_streaming(args, transport, policy, requests, rates, goodput))
    return finish(args, runs, "orca bench")


def engine_config(args: argparse.Namespace, policy: str) -> EngineConfig:
    """The engine of one --policy item: the engine flags, the item's policy and max batch size, and
    --model or the demo model `orca serve` uses."""
    from loadtest.targets import resolved_model

    name, max_num_seqs = parse_policy(policy, args.max_num_seqs)
    return engine_config_from_args(args, BENCH_ENGINE_FIELDS, model=resolved_model(args.model), policy=name,
                                   max_num_seqs=max_num_seqs)


def bench_inprocess(args, policy, requests, rates, goodput) -> list[dict]:
    """A fresh engine for every rate, so no run inherits another's state (KV layout, allocator)."""
    from loadtest.targets import make_inprocess_target

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = engine_config(args, policy)
    runs = []
    for rate in rates:
        target = make_inprocess_target(config)
        target.warm_up()
        arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
        result = drive_stepped(target, tagged(requests), arrivals, max_concurrency=args.max_concurrency,
                               desc=f"{policy} @ {_rate_text(rate)} req/s", progress=not args.disable_tqdm)
        runs.append(run_record(policy, rate, args, result, goodput,
                               {"transport": "inprocess", "model": target.engine.config.model.model}))
        del target
    return runs


async def bench_streaming(args, transport, policy, requests, rates, goodput) -> list[dict]:
    from loadtest.targets import HttpTarget, NatsTarget, warm_up_streaming

    served_name = None if args.launch else args.model  # a launched server serves --model under its own name
    target = NatsTarget(args.nats_url) if transport == "nats" else HttpTarget(args.base_url, served_name, args.api_key)
    runs = []
    async with target:
        warm = GenerateRequest(id=f"bwarm{uuid.uuid4().hex[:8]}", prompt_token_ids=list(range(10, 74)), max_tokens=4,
                               temperature=0.0, ignore_eos=True)
        await warm_up_streaming(target, warm)
        for rate in rates:
            arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
            result = await drive_streaming(target, tagged(requests), arrivals, max_concurrency=args.max_concurrency,
                                           timeout_s=args.request_timeout, desc=f"{policy} @ {_rate_text(rate)} req/s",
                                           progress=not args.disable_tqdm)
            runs.append(run_record(policy, rate, args, result, goodput, {"transport": transport, "model": args.model}))
    return runs


# ---- orca simulate ----------------------------------------------------------------------

def cmd_simulate(args: argparse.Namespace) -> int:
    from loadtest.cost_models import make_cost_model
    from loadtest.simulator import simulate

    prepare_outputs(args)
    cost_model = make_cost_model(args.cost_model, tp=args.tp, pp=args.pp)
    kv_cache_tokens = args.kv_cache_tokens or cost_model.default_kv_cache_tokens  # None: what fits beside the weights
    cache = section_from_args("cache", args, kv_cache_tokens=kv_cache_tokens)
    if args.trace:
        requests, trace_arrivals = load_trace(args.trace, vocab_size=args.vocab_size, seed=args.seed)
        rates = [None]
    else:
        requests, trace_arrivals, rates = with_token_ids(workload(args), args.model), None, rates_of(args)
    goodput, runs = parse_goodput(args.goodput), []
    specs = {spec: parse_policy(spec, args.max_num_seqs) for spec in args.policy}
    for policy, (name, max_num_seqs) in specs.items():
        scheduler = section_from_args("scheduler", args, policy=name, max_num_seqs=max_num_seqs)
        for rate in rates:
            arrivals = trace_arrivals or arrival_times(len(requests), rate, args.burstiness, args.seed)
            result = simulate(requests, arrivals, scheduler, cost_model, cache=cache, max_model_len=args.max_model_len,
                              max_concurrency=args.max_concurrency, progress=not args.disable_tqdm,
                              desc=f"simulating {policy} @ {_rate_text(rate)} req/s")
            runs.append(run_record(policy, rate, args, result, goodput, {"cost_model": args.cost_model}))
    return finish(args, runs, "orca simulate")


# ---- summary, capacity, save, plot ------------------------------------------------------------

def finish(args: argparse.Namespace, runs: list[dict], kind: str) -> int:
    runs = _kept_apart(_loaded_runs(args.load_result) + runs)
    if not runs:
        raise ValueError("nothing measured and nothing loaded")
    curves, rates = sweep_curves(runs)
    policies = {_label(run): run["policy"] for run in runs}
    target, how = latency_target(args, runs)
    capacities = {policy: capacity_at(points, target) for policy, points in curves.items()}
    print(sweep_table(runs))
    ratio_lines = report_capacities(capacities, policies, target, how)
    if getattr(args, "cost_model", None) == "gpt3-175b-a100-tp8pp2" and target == PAPER_TARGET_MS:
        ratio_lines += paper_comparison(capacities, policies)
    if args.save_result:
        save(args, kind, runs, target, capacities, ratio_lines)
    if args.plot:
        from loadtest.plot import plot_curves

        title, subtitle = plot_titles(args, runs)
        items = {label: label.split(" (", 1)[0] for label in curves}  # 'static:8 (sim)' -> 'static:8'
        plot_curves(curves, args.plot, target_ms=target, capacities=capacities, title=title, subtitle=subtitle,
                    rate_labels=rates, policies=items)
        print(f"plot: {args.plot}")
    return 0


def _label(run: dict) -> str:
    return run.get("label") or run["policy"]


def _rate_key(run: dict) -> float:
    rate = run["request_rate"]
    return {"inf": math.inf, "trace": 0.0}.get(rate) if rate in ("inf", "trace") else float(rate)


def sweep_curves(runs: list[dict]) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[str]]]:
    """Policy -> (throughput, median normalized latency) in order of increasing offered rate,
    and policy -> those points' offered rates."""
    curves: dict[str, list[tuple[float, float]]] = {}
    rates: dict[str, list[str]] = {}
    order = {"orca": 0, "request-level": 1}
    for run in sorted(runs, key=lambda r: (order.get(_label(r), 2), _label(r), _rate_key(r))):
        m = run["metrics"]
        if m["completed"]:
            curves.setdefault(_label(run), []).append((m["request_throughput"], m["median_norm_latency_ms"]))
            rates.setdefault(_label(run), []).append(run["request_rate"])
    return curves, rates


def latency_target(args: argparse.Namespace, runs: list[dict]) -> tuple[float, str]:
    """The target in ms/token, and where it comes from."""
    if args.latency_target is not None:
        return args.latency_target, ""
    if getattr(args, "cost_model", None) == "gpt3-175b-a100-tp8pp2":
        return PAPER_TARGET_MS, "the Orca paper's"
    lowest = min(r["metrics"]["median_norm_latency_ms"] for r in runs if r["metrics"]["completed"])
    return round(AUTO_TARGET_FACTOR * lowest, 1), f"auto: {AUTO_TARGET_FACTOR:g}x the lowest median measured"


def sweep_table(runs: list[dict]) -> str:
    width = max(15, *(len(_label(r)) + 2 for r in runs))
    head = (f"{'policy':<{width}}{'rate':>7}{'done':>6}{'fail':>5}{'req/s':>9}{'tok/s':>9}{'TTFT':>10}{'TPOT':>8}"
            f"{'e2e':>10}{'norm lat':>10}{'p99 norm':>10}")
    lines = ["", "sweep summary (medians in ms; norm lat = e2e / output tokens, ms/token)", head, "-" * len(head)]
    for run in sorted(runs, key=lambda r: (_label(r), _rate_key(r))):
        m = run["metrics"]
        lines.append(f"{_label(run):<{width}}{run['request_rate']:>7}{m['completed']:>6.0f}{m['failed']:>5.0f}"
                     f"{m['request_throughput']:>9.3f}{m['output_throughput']:>9.1f}{m['median_ttft_ms']:>10.1f}"
                     f"{m['median_tpot_ms']:>8.1f}{m['median_e2el_ms']:>10.0f}{m['median_norm_latency_ms']:>10.1f}"
                     f"{m['p99_norm_latency_ms']:>10.1f}")
    return "\n".join(lines)


def report_capacities(capacities: dict[str, Capacity], policies: dict[str, str], target: float,
                      how: str) -> list[str]:
    """Print each curve's capacity, and each non-orca curve's ratio to its orca counterpart."""
    at = f"{target:g} ms/token{f' ({how})' if how else ''}"
    print(f"\ncapacity at {at} (highest throughput whose median normalized latency stays under it):")
    width = max(len(label) for label in capacities) + 2
    for label, cap in capacities.items():
        print(f"  {label:<{width}} {cap.describe()}")
    lines = []
    for label in capacities:
        orca = counterpart(label, policies.get(label, label), capacities)
        if orca is None:
            continue
        ratio, bound = capacity_ratio(capacities[orca], capacities[label])
        sign = {"=": "", ">=": ">= ", "<=": "<= ", "?": "~"}[bound]
        lines.append(f"capacity ratio {orca} / {label} at {at}: {sign}{ratio:.2f}x")
        print(lines[-1] + (" (a curve never crossed the target: widen --sweep for an exact ratio)" if sign else ""))
    return lines


PAPER_CAPACITY = {"orca": 6.81, "static": 0.185}
"""Req/s at 190 ms/token on GPT-3 175B (Yu et al., OSDI '22, section 6.2): ORCA and FasterTransformer."""
PAPER_RATIO = 36.9
"""The same section's speedup, as the paper rounds it."""


def paper_comparison(capacities: dict[str, Capacity], policies: dict[str, str]) -> list[str]:
    """Beside the paper's 175B figures: orca, the best static curve (the paper's FasterTransformer
    figure is its best (max_bs, mbs) configuration at that latency), their ratio, and with a
    request-level curve how the gain splits between selective batching and iteration-level scheduling."""
    def best(policy: str) -> str | None:
        labels = [label for label, p in policies.items() if p == policy and label in capacities]
        return max(labels, key=lambda label: capacities[label].req_s, default=None)

    orca, static, request_level = best("orca"), best("static"), best("request-level")
    if orca is None or static is None:
        return []
    lines = [f"the Orca paper's GPT-3 175B comparison at {PAPER_TARGET_MS:g} ms/token (Yu et al., OSDI '22, section 6.2):",
             f"  {'':<28}{'simulated':>16}  paper",
             f"  {orca:<28}{capacities[orca].describe():>16}  {PAPER_CAPACITY['orca']} req/s (ORCA)",
             f"  {static + ' (best static)':<28}{capacities[static].describe():>16}  {PAPER_CAPACITY['static']} req/s "
             "(FasterTransformer, its best configuration)"]
    ratio, bound = capacity_ratio(capacities[orca], capacities[static])
    lines.append(f"  {orca + ' / ' + static:<28}{_ratio_text(ratio, bound):>16}  {PAPER_RATIO}x")
    if request_level is not None:
        selective = capacity_ratio(capacities[request_level], capacities[static])
        iteration = capacity_ratio(capacities[orca], capacities[request_level])
        lines += [f"  {request_level:<28}{capacities[request_level].describe():>16}  -",
                  f"  split: {static} -> {request_level} {_ratio_text(*selective)} (selective batching: a batch of any "
                  "lengths, no lockstep or dead lanes, so large batches pay; finished requests return at once)",
                  f"         {request_level} -> {orca} {_ratio_text(*iteration)} (iteration-level scheduling: new "
                  "requests join a running batch)"]
    print("\n" + "\n".join(lines))
    return lines


def _ratio_text(ratio: float, bound: str) -> str:
    return {"=": "", ">=": ">= ", "<=": "<= ", "?": "~"}[bound] + f"{ratio:.2f}x"


def counterpart(label: str, policy: str, labels) -> str | None:
    """The orca curve to compare a curve with. For 'static:8 (simulated)': 'orca:8 (simulated)',
    else 'orca (simulated)', else what `orca_counterpart` picks."""
    if policy == "orca":
        return None
    rest = label[len(policy):] if label.startswith(policy) else ""
    suffix = rest.split(" ", 1)[1] if rest.startswith(":") and " " in rest else ""
    for twin in ("orca" + rest, "orca " + suffix if suffix else None):
        if twin in labels:
            return twin
    return orca_counterpart(label, policy, labels)


def save(args, kind, runs, target, capacities, ratio_lines) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("func", "load_result") and not callable(v)}
    body = {"kind": kind, "date": datetime.datetime.now().isoformat(timespec="seconds"), "config": config,
            "latency_target_ms": target,
            "capacity": {label: {"req_s": c.req_s, "kind": c.kind} for label, c in capacities.items()},
            "capacity_ratios": ratio_lines, "runs": runs}
    with open(args.save_result, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
    print(f"saved: {args.save_result}")


def plot_titles(args: argparse.Namespace, runs: list[dict]) -> tuple[str, str]:
    simulated = [r["cost_model"] for r in runs if r.get("cost_model")]
    measured = [r for r in runs if not r.get("cost_model")]
    where = {"gpt3-175b-a100-tp8pp2": "GPT-3 175B on 16x A100-40GB, TP8 x PP2 (cost model)",
             "this-machine": "tiny demo model on this CPU (fitted cost model)"}
    if measured:
        names = {"inprocess": "engine in process", "nats": "orca serve over NATS", "http": "orca serve over HTTP"}
        transports = list(dict.fromkeys(names.get(r.get("transport"), "saved runs") for r in measured))
        transport = transports[0] if len(transports) == 1 else " vs ".join(transports)
        model = measured[-1].get("model") or getattr(args, "model", None)
        model = os.path.basename(os.path.normpath(model)) if model else "demo model"
        title = f"orca bench: {model}, {transport}"
        if simulated:
            title = f"Measured vs simulated: {model}, {transport}"
    else:
        title = f"Simulated: {where.get(simulated[-1], simulated[-1])}"
    shape = " / ".join(dict.fromkeys(r.get("workload") or workload_text(vars(args)) for r in runs))
    burstiness = sorted({r.get("burstiness", args.burstiness) for r in runs})
    arrivals = ("Poisson" if burstiness == [1] else
                f"gamma arrivals (burstiness {'/'.join(f'{b:g}' for b in burstiness)})")
    counts = sorted({r["num_prompts"] for r in runs})
    return title, f"{shape}; {arrivals}; {'/'.join(map(str, counts))} requests per point"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orca", description=__doc__)
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"orca: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
