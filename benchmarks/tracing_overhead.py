"""What the engine's telemetry costs per iteration: the engine master's loop (schedule, execute,
update, then `EngineTelemetry.on_iteration`, as in services/engine/master.py) run three ways on
the same workload, interleaved and repeated:

- `off`: no telemetry call at all;
- `metrics`: EngineTelemetry with tracing off (histograms and counters only: the default);
- `tracing`: EngineTelemetry with the real OTel SDK, every span sampled, BatchSpanProcessor
  exporting JSON lines to a file (so the exporter thread's CPU competes with the loop, as it would).

The model step is a synthetic runner (one token per sampling request) so the loop's own cost is
what is measured; `--model DIR` runs the real model runner instead, to put the overhead next to a
real iteration. Prints microseconds per iteration per mode (median of the repeats) and the overhead.

    python benchmarks/tracing_overhead.py [--requests 256] [--repeats 5] [--model .cache/demo-llama]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.batch import RunnerOutput, StepResult  # noqa: E402
from core.kv_cache import KVCacheManager  # noqa: E402
from core.policies import make_policy  # noqa: E402
from core.request import Request  # noqa: E402
from core.scheduler import Scheduler  # noqa: E402
from services.engine.telemetry import EngineTelemetry  # noqa: E402
from shared.messages import TokenizedRequest  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.telemetry import JsonLinesSpanExporter, TelemetryConfig, traceparent  # noqa: E402

MODES = ("off", "metrics", "tracing")


def workload(num: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(10, 1000) for _ in range(rng.randint(16, 96))], rng.randint(16, 64))
            for i in range(num)]


def tracer_to_file(path: str):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
    return provider, provider.get_tracer("orca.engine")


def run(mode: str, requests, args, runner) -> tuple[float, int]:
    """Seconds spent in the loop and iterations run."""
    scheduler = Scheduler(make_policy("orca"), KVCacheManager(args.kv_blocks, 16), max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=8192, max_model_len=2048)
    provider = tracer = None
    if mode == "tracing":
        provider, tracer = tracer_to_file(os.path.join(args.tmp, "spans.jsonl"))
    telemetry = None if mode == "off" else EngineTelemetry(None, "0", scheduler, tracer=tracer,
                                                             config=TelemetryConfig())
    admitted = []
    for rid, prompt, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        parent = tracer.start_span("text_completion") if tracer else None  # the tokenizer's span, made elsewhere
        scheduler.add_request(Request(rid, list(prompt), params))
        admitted.append(TokenizedRequest(rid, prompt, params, "tok", time.time(),
                                         trace_context=traceparent(parent) if parent else None))
    if telemetry:
        telemetry.on_admit(admitted)
    iterations = 0
    start = time.perf_counter()
    while scheduler.has_unfinished:
        started = time.perf_counter()
        output = scheduler.schedule()
        result = StepResult(output.iteration, runner(output))
        events = scheduler.update(output, result.output)
        if telemetry:
            telemetry.on_iteration(output, result, events, started)
        iterations += 1
    elapsed = time.perf_counter() - start
    if provider is not None:
        provider.shutdown()  # flush: the export thread's work belongs to this mode
    return elapsed, iterations


def synthetic_runner(output) -> RunnerOutput:
    return RunnerOutput({s.request_id: 7 for s in output.scheduled if s.samples})


def model_runner(model_dir: str, kv_blocks: int):
    from model.runner import ModelRunner

    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=kv_blocks, block_size=16,
                         max_model_len=2048, seed=0)

    def execute(output) -> RunnerOutput:
        return runner.execute(output)
    return execute, runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="run the real model runner (CPU) instead of a synthetic one")
    args = parser.parse_args()
    requests = workload(args.requests)
    per_iteration: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for repeat in range(args.repeats):
            for mode in MODES:  # interleaved, so drift in the machine's load hits every mode alike
                if args.model:
                    execute, runner = model_runner(args.model, args.kv_blocks)
                else:
                    execute, runner = synthetic_runner, None
                elapsed, iterations = run(mode, requests, args, execute)
                per_iteration[mode].append(elapsed / iterations * 1e6)
                del runner
    base = statistics.median(per_iteration["off"])
    print(f"{args.requests} requests, max_num_seqs {args.max_num_seqs}, {iterations} iterations per run, "
          f"{'model ' + args.model if args.model else 'synthetic runner'}, median of {args.repeats}")
    for mode in MODES:
        value = statistics.median(per_iteration[mode])
        spread = f"{min(per_iteration[mode]):.1f}-{max(per_iteration[mode]):.1f}"
        print(f"  {mode:8s} {value:9.1f} us/iteration  (range {spread})  overhead {value - base:+8.1f} us "
              f"({(value / base - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
