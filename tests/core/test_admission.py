"""The admission core: FCFS across engines, only on reported room, never counting a report twice."""

from __future__ import annotations

import pytest

from core.admission import AdmissionQueue, QueueFull
from shared.messages import EngineStatus, TokenizedRequest
from shared.sampling import SamplingParams


def status(replica="0", blocks=100, running=0, seqs=8, ack=0, incarnation="a", ready=True) -> EngineStatus:
    return EngineStatus(replica=replica, incarnation=incarnation, ready=ready, block_size=1, num_blocks=100,
                        admissible_blocks=blocks, num_running=running, num_waiting=0, max_num_seqs=seqs,
                        max_model_len=64, last_admit_sequence=ack, iteration=0, kv_used_blocks=100 - blocks)


def request(rid: str, prompt_len=10, max_tokens=10) -> TokenizedRequest:
    return TokenizedRequest(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), "tok", 0.0)


def ids(decisions):
    return {replica: [r.request_id for r in reqs] for replica, _, reqs in decisions}


def test_admits_while_the_reported_room_lasts_then_waits_for_an_acknowledgement():
    q = AdmissionQueue(10)
    q.on_status(status(blocks=50))
    for i in range(4):
        q.submit(request(f"r{i}"))  # 20 slots each
    assert ids(q.decide()) == {"0": ["r0", "r1"]}
    assert q.decide() == []  # same report: not counted twice
    q.on_status(status(blocks=50, ack=1))
    assert ids(q.decide()) == {"0": ["r2", "r3"]}


def test_fcfs_head_blocks_even_if_a_later_request_would_fit():
    q = AdmissionQueue(10)
    q.on_status(status(blocks=15))
    q.submit(request("big", 10, 10))
    q.submit(request("small", 2, 2))
    assert q.decide() == []


def test_routes_to_the_engine_with_most_room():
    q = AdmissionQueue(10)
    q.on_status(status("0", blocks=30))
    q.on_status(status("1", blocks=90))
    q.submit(request("a"))
    q.submit(request("b"))
    assert ids(q.decide()) == {"1": ["a", "b"]}


def test_not_ready_engines_and_full_engines_get_nothing():
    q = AdmissionQueue(10)
    q.on_status(status("0", ready=False))
    q.on_status(status("1", running=8, seqs=8))
    q.submit(request("a"))
    assert q.decide() == []


def test_queue_bound_and_a_resubmission_replaces_the_queued_copy_in_its_place():
    q = AdmissionQueue(2)
    q.submit(request("a"))
    q.submit(request("b"))
    q.submit(request("a", max_tokens=3))  # its tokenizer sent it again (a new admission, or a resume)
    assert list(q.queue) == ["a", "b"] and q.queue["a"].params.max_tokens == 3
    with pytest.raises(QueueFull):
        q.submit(request("c"))


def test_a_restarted_engine_is_offered_work_again():
    q = AdmissionQueue(10)
    q.on_status(status(blocks=100))
    q.submit(request("a"))
    q.decide()
    q.on_status(status(blocks=100, ack=0, incarnation="b"))  # restarted: its count starts over
    q.submit(request("b"))
    assert ids(q.decide()) == {"0": ["b"]}


def test_requests_no_engine_could_ever_serve_are_named():
    q = AdmissionQueue(10)
    q.on_status(status())
    assert "context" in q.unservable(request("a", prompt_len=64))
    assert q.unservable(request("b")) is None


def test_a_null_max_tokens_reserves_the_context_or_the_cache_whichever_is_smaller():
    from core.admission import reservation_blocks
    from shared.messages import EngineStatus, TokenizedRequest
    from shared.sampling import SamplingParams

    def status(num_blocks: int) -> EngineStatus:
        return EngineStatus(replica="0", incarnation="i", ready=True, block_size=16, num_blocks=num_blocks,
                            admissible_blocks=num_blocks, num_running=0, num_waiting=0, max_num_seqs=4,
                            max_model_len=1024, last_admit_sequence=0, iteration=0, kv_used_blocks=0)

    request = TokenizedRequest("r", [1, 2, 3], SamplingParams(max_tokens=None), "tok", 0.0)
    assert reservation_blocks(request, status(1000)) == 1024 // 16
    assert reservation_blocks(request, status(32)) == 32
