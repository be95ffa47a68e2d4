"""Tensor and pipeline parallelism in process (`orca generate`'s engine): worker processes in a
gloo group. Greedy float64 output must not depend on how the model is split."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.llm_engine import Completion, LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.services.stack import ROOT

pytestmark = pytest.mark.slow

PROMPTS = [[5 + 7 * i + j for j in range(3 + 9 * i)] for i in range(6)]


def engine(model: str, tp: int, pp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype="float64"), scheduler=SchedulerConfig(max_num_seqs=4),
        cache=CacheConfig(kv_cache_tokens=4096, block_size=8),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)))


def complete(e: LLMEngine, params: list[SamplingParams]) -> dict[str, Completion]:
    """PROMPTS (request r<i> with params[i]) run to their end on `e`, which is then closed: each
    request's final completion."""
    try:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            e.add_request(f"r{i}", prompt, p)
        done: dict[str, Completion] = {}
        while e.has_unfinished:
            for delta in e.step():
                if delta.finished:
                    done[delta.completion.request_id] = delta.completion
    finally:
        e.close()
    return done


def generate(model: str, tp: int, pp: int) -> tuple[dict[str, list[int]], LLMEngine]:
    e = engine(model, tp, pp)
    e.record_iterations = True
    done = complete(e, [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True)
                        for i in range(len(PROMPTS))])
    assert e.kv_cache.num_used_blocks == 0
    return {rid: c.token_ids for rid, c in done.items()}, e


@pytest.fixture(scope="module")
def reference(demo_model, demo_gpt2) -> dict[str, dict[str, list[int]]]:
    return {"llama": generate(demo_model, 1, 1)[0], "gpt2": generate(demo_gpt2, 1, 1)[0]}


@pytest.mark.parametrize("arch,tp,pp", [
    ("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2),
    ("llama", 4, 1),  # 2 KV heads on 4 ranks: each KV head replicated on two
    ("gpt2", 2, 1), ("gpt2", 1, 2), ("gpt2", 2, 2),
])
def test_greedy_output_does_not_depend_on_the_split(arch, tp, pp, reference, demo_model, demo_gpt2):
    tokens, _ = generate(demo_model if arch == "llama" else demo_gpt2, tp, pp)
    assert tokens == reference[arch]


def test_two_stages_keep_two_batches_in_flight_with_different_requests(demo_model, reference):
    tokens, e = generate(demo_model, 1, 2)
    assert tokens == reference["llama"]
    by_iteration = {out.iteration: {s.request_id for s in out.scheduled} for out in e.iterations}
    pairs = [record for record in e.in_flight_log if len(record) == 2]
    assert len(pairs) > len(e.in_flight_log) // 2, "the pipeline was mostly not full"
    for first, second in pairs:
        assert not by_iteration[first] & by_iteration[second], "a request was in two batches in flight"


def test_orca_generate_with_tp_and_pp_writes_the_same_results(demo_model, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": 12, "temperature": 0,
                                            **({"prompt_logprobs": 2} if i == 0 else {})}) + "\n"
                                for i, p in enumerate(["def main():", "import os", "class A:", "x = 1"])))

    def run(*flags: str) -> list[dict]:
        out = tmp_path / f"out{'-'.join(flags)}.jsonl"
        done = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", demo_model,
                               "--dtype", "float64", "--input", str(requests), "--output", str(out),
                               "--no-progress", *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return list(map(json.loads, out.read_text().splitlines()))

    split, whole = run("-tp", "2", "-pp", "2"), run()
    keys = ("id", "text", "token_ids", "finish_reason")
    assert [{k: r[k] for k in keys} for r in split] == [{k: r[k] for k in keys} for r in whole]
    # the prompt's logprobs come from the output rank (last stage, TP rank 0), as the sampled tokens do
    got, expected = split[0]["prompt_logprobs"], whole[0]["prompt_logprobs"]
    assert [lp["token_id"] for lp in got] == whole[0]["prompt_token_ids"][1:] == [lp["token_id"] for lp in expected]
    for a, b in zip(got, expected):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-9)
        assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"] for t in b["top_logprobs"]]


def test_a_split_the_model_does_not_allow_is_refused_before_any_worker_starts(demo_model):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        engine(demo_model, 3, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds the model's 4 layers"):
        engine(demo_model, 1, 5)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_constrained_outputs_do_not_depend_on_the_split(demo_model, tp, pp):
    """The grammar lives on the output rank (last stage, TP rank 0): its mask gives the same greedy
    tokens, and every output still matches, however the model is split."""
    import jsonschema

    from shared.structured import StructuredOutputs

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}
    specs = [StructuredOutputs(json=schema), StructuredOutputs(regex=r"[a-z]{2,6}"), StructuredOutputs(choice=["x", "y"])]

    def run(tp: int, pp: int) -> dict[str, str]:
        done = complete(engine(demo_model, tp, pp), [
            SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=specs[i % len(specs)])
            for i in range(len(PROMPTS))])
        return {rid: c.text for rid, c in done.items()}

    split = run(tp, pp)
    assert split == run(1, 1)
    for i in range(0, len(PROMPTS), 3):
        jsonschema.validate(json.loads(split[f"r{i}"]), schema)
