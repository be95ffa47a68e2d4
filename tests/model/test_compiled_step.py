"""The torch.compile'd model step (model/compiled.py) against the eager one, on every architecture.

A module of its own, so that pytest-xdist can run its compiles (the suite's longest unit tests on a fresh
clone, whose Inductor cache is empty) beside test_hf_equivalence rather than after it.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import ARCHS, make_checkpoint
from tests.model.engine_runs import orca_run, torch_threads, workload


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return arch, make_checkpoint(arch, tmp_path_factory.mktemp(arch), sharded=arch == "llama")


@pytest.mark.parametrize("policy,chunked,prefix,kv_tokens", [("orca", False, False, 4096), ("paged", True, True, 80)])
def test_compiled_step_equals_the_eager_step_float32(checkpoint, policy, chunked, prefix, kv_tokens):
    """torch.compile'd step (model/compiled.py): the eager step's greedy tokens, logprobs within 1e-4,
    also under preemption, chunked prefill and prefix reuse."""
    arch, model_dir = checkpoint
    if policy == "paged" and arch != "llama":
        pytest.skip("one architecture covers the paged path; each compile costs seconds")
    prompts = workload(seed=2, n=6, shared_prefix=prefix)
    # With more than one torch thread the CPU runner switches thread counts, and Inductor compiles one graph per
    # count: llama checks that the warm-up compiles them all. The other architectures check their own lowering
    # with one thread, one graph (each graph cost 8-13 s of CPU on a fresh clone).
    threads = torch.get_num_threads() if arch == "llama" else 1
    with torch_threads(threads):
        runs = [orca_run(model_dir, prompts, dtype="float32", logprobs=3, policy=policy, block_size=4,
                         chunked=chunked, kv_cache_tokens=kv_tokens, prefix=prefix, enforce_eager=eager)
                for eager in (True, False)]
    eager, compiled = runs
    for i in range(len(prompts)):
        assert compiled[i].token_ids == eager[i].token_ids, i
        for a, b in zip(compiled[i].logprobs, eager[i].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    if kv_tokens < 100:
        assert compiled["preemptions"] > 0, "the test meant to force preemption"
