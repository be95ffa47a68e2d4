"""The scheduler's side of structured outputs: a request waits, unadmitted, until the output rank says
its grammar compiled; nobody behind it waits with it; a step that only waits is sent when nothing else
runs; a failed grammar ends its request with an error; a worker lost mid-compile gets the order again."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import RunnerOutput
from core.request import Request
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from shared.structured import StructuredOutputs
from tests.core.helpers import EOS, fake_step, make_request, make_scheduler

CHOICE = StructuredOutputs(choice=["a", "b"])


def structured_request(request_id: str, prompt_len: int = 4, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=CHOICE)
    return Request(request_id, list(range(10, 10 + prompt_len)), params, eos_token_ids=(EOS,))


def test_a_request_waits_for_its_grammar_and_those_behind_it_do_not():
    s = make_scheduler()
    s.add_request(structured_request("g"))
    s.add_request(make_request("plain", 4, 4))
    first = s.schedule()
    assert [x.request_id for x in first.scheduled] == ["plain"]
    assert first.grammars == {"g": CHOICE} and first.awaiting_grammars
    s.update(first, fake_step(first))
    second = s.schedule()
    assert [x.request_id for x in second.scheduled] == ["plain"] and not second.grammars
    assert second.awaiting_grammars, "the runner is told to report on the compile"
    s.update(second, msgspec.structs.replace(fake_step(second), grammars_ready=["g"]))
    third = s.schedule()
    assert {x.request_id for x in third.scheduled} == {"plain", "g"}
    assert not third.awaiting_grammars


def test_a_constraint_compiled_before_is_ready_at_once_until_a_worker_is_lost():
    s = make_scheduler()
    s.add_request(structured_request("first"))
    s.update(s.schedule(), RunnerOutput(grammars_ready=["first"]))
    s.add_request(structured_request("second"))
    step = s.schedule()
    assert {x.request_id for x in step.scheduled} == {"first", "second"} and not step.grammars
    s.preempt_all()
    s.add_request(structured_request("third"))
    assert "third" in s.schedule().grammars, "a restarted worker compiles it again"


def test_with_nothing_else_to_run_one_step_waits_for_the_compile():
    s = make_scheduler()
    s.add_request(structured_request("g"))
    poll = s.schedule()
    assert not poll.is_empty and not poll.scheduled and poll.grammars == {"g": CHOICE}
    assert s.schedule().is_empty, "one waiting step at a time"
    s.update(poll, RunnerOutput())
    again = s.schedule()
    assert not again.is_empty and not again.grammars and again.awaiting_grammars
    s.update(again, RunnerOutput(grammars_ready=["g"]))
    assert [x.request_id for x in s.schedule().scheduled] == ["g"]


def test_a_grammar_that_fails_ends_its_request_with_the_error():
    s = make_scheduler()
    s.add_request(structured_request("g"))
    poll = s.schedule()
    events = s.update(poll, RunnerOutput(grammar_errors={"g": "too complex"}))
    assert [(e.request_id, e.finish_reason) for e in events] == [("g", FinishReason.ERROR)]
    assert "too complex" in events[0].error
    assert not s.has_unfinished and s.schedule().is_empty


def test_grammar_done_finishes_the_request_with_stop():
    s = make_scheduler()
    s.add_request(structured_request("g", max_tokens=10))
    s.update(s.schedule(), RunnerOutput(grammars_ready=["g"]))
    step = s.schedule()
    events = s.update(step, msgspec.structs.replace(fake_step(step), grammar_done=["g"]))
    assert events[-1].finish_reason is FinishReason.STOP and not s.has_unfinished


def test_an_aborted_waiting_request_is_forgotten():
    s = make_scheduler()
    s.add_request(structured_request("g"))
    s.abort("g")
    assert s.schedule().is_empty


def test_a_worker_lost_while_compiling_is_asked_again():
    s = make_scheduler()
    s.add_request(structured_request("g"))
    s.add_request(make_request("plain", 4, 8))
    s.schedule()  # the order went out with this step; the worker died running it
    s.preempt_all()
    step = s.schedule()
    assert step.grammars == {"g": CHOICE}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(1, 5)), min_size=1, max_size=8),
       st.integers(0, 3))
def test_every_request_ends_whatever_order_the_compiles_finish_in(requests, compile_steps):
    """Property: compiles that take any number of steps never lose or hang a request, and no request
    with a grammar runs before its grammar is ready."""
    s = make_scheduler(num_blocks=64, max_num_seqs=4)
    for i, (structured, prompt_len, max_tokens) in enumerate(requests):
        s.add_request(structured_request(f"r{i}", prompt_len, max_tokens) if structured
                      else make_request(f"r{i}", prompt_len, max_tokens))
    ordered_at: dict[str, int] = {}
    ready: set[str] = set()
    finished: set[str] = set()
    for step_number in range(500):
        if not s.has_unfinished:
            break
        out = s.schedule()
        assert not out.is_empty, "a step is always sent while requests remain and nothing is in flight"
        for rid in out.grammars:
            ordered_at[rid] = step_number
        assert all(x.request_id in ready or x.request_id not in ordered_at for x in out.scheduled)
        now_ready = [r for r, at in ordered_at.items() if r not in ready and step_number - at >= compile_steps]
        ready.update(now_ready)
        result = msgspec.structs.replace(fake_step(out), grammars_ready=now_ready)
        finished.update(e.request_id for e in s.update(out, result) if e.finished)
    assert finished == {f"r{i}" for i in range(len(requests))}
