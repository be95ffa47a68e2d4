"""The CPU runner runs small iterations on one torch thread, a large one that decodes nothing on the threads
it may borrow too, and leaves the process's count as it found it."""

from __future__ import annotations


import pytest
import torch

from engine.executor import RunnerArgs
from engine.llm_engine import LLMEngine
from model.runner import SMALL_STEP_TOKENS
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams
from tests.model.checkpoints import make_checkpoint


def test_small_steps_leave_the_thread_count_and_a_second_engine_gets_every_thread(tmp_path):
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one core: the runner never switches")
    config = EngineConfig(model=ModelConfig(model=str(make_checkpoint("llama", tmp_path)), dtype="float32"))
    engine = LLMEngine(config)
    seen: list[int] = []
    run_layers = engine.runner.model.run_layers

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_layers(*args, **kwargs)

    engine.runner.model.run_layers = spy
    engine.add_request("r", list(range(1, SMALL_STEP_TOKENS + 9)),
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert seen == [threads, 1, 1, 1], "a large prefill on every thread, then one-token decodes on one"
    assert torch.get_num_threads() == threads, "the runner kept one thread after its last small step"
    assert LLMEngine(config).runner.max_threads == threads


def test_a_worker_that_may_borrow_runs_a_prefill_that_decodes_nothing_on_more_threads(tmp_path):
    """A served worker on one core of two (`orca serve --cpu-bind auto` on two cores) borrows the
    control plane's for an iteration that decodes nothing, and only for that one."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one core: nothing to borrow")
    config = EngineConfig(model=ModelConfig(model=str(make_checkpoint("llama", tmp_path)), dtype="float32"))
    torch.set_num_threads(1)  # the worker's own: one core
    try:
        runner = RunnerArgs(config, 1024, borrowed_threads=1).build()
    finally:
        torch.set_num_threads(threads)
    engine = LLMEngine(config, runner=runner)
    seen: list[tuple[int, int, int]] = []
    execute = runner._execute

    def spy(scheduler_output):
        seen.append((scheduler_output.num_tokens, scheduler_output.num_decode_tokens, torch.get_num_threads()))
        return execute(scheduler_output)

    runner._execute = spy
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, SMALL_STEP_TOKENS + 9))
    engine.add_request("alone", prompt, params)
    engine.step()
    engine.step()
    engine.add_request("beside a decode", prompt, params)
    while engine.has_unfinished:
        engine.step()
    assert seen[0] == (len(prompt), 0, 2), "a large prefill alone borrows a thread"
    assert seen[1] == (1, 1, 1), "a decode runs on the worker's own thread"
    assert seen[2] == (len(prompt) + 1, 1, 1), "a large prefill beside a decode stays on it too"
    assert {count for _, _, count in seen[1:]} == {1}
    assert torch.get_num_threads() == threads
