"""The CPU runner runs small iterations on one torch thread and leaves the process's count as it found it."""

from __future__ import annotations

import pytest
import torch

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
