"""The gateway's aggregation of metric snapshots (several tokenizers, several engine replicas, a
restarted process, a silent one), rendered by the real collector and read back with
prometheus_client's parser; and the snapshots travelling over a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import STALE_S, MetricsBoard, render_system_metrics
from shared import subjects
from shared.codec import Codec
from shared.messages import AdmissionMetrics, EngineMetrics, RequestPhases, RequestSizes, TokenizerMetrics
from shared.outputs import FinishReason
from shared.telemetry import (BATCH_SIZE_BUCKETS, ITERATION_TOKEN_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS,
                              TOKEN_COUNT_BUCKETS, TTFT_BUCKETS, Histogram, SnapshotPublisher)


def hist(bounds, values) -> object:
    h = Histogram(bounds)
    for v in values:
        h.observe(v)
    return h.data()


def tokenizer(source: str, prompt: int, generated: int, ttfts: list[float], finished: dict) -> TokenizerMetrics:
    return TokenizerMetrics(source, prompt, generated, finished, hist(TTFT_BUCKETS, ttfts), hist(ITL_BUCKETS, []),
                            hist(LATENCY_BUCKETS, [1.0] * len(ttfts)), num_active=1)


def engine(source: str, replica: str, *, running: int, used_blocks: int, preemptions: int,
           iteration_tokens: list[int]) -> EngineMetrics:
    return EngineMetrics(source, replica, "orca", running, 0, 8, 100, 16, used_blocks, used_blocks * 16,
                         used_blocks * 10, preemptions, len(iteration_tokens), hist(LATENCY_BUCKETS, [0.2]),
                         hist(ITERATION_TOKEN_BUCKETS, iteration_tokens), hist(BATCH_SIZE_BUCKETS, [1]))


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_add_up_across_processes_and_restarts_and_gauges_only_from_live_ones():
    board, now = MetricsBoard(), 1000.0
    board.on_snapshot(tokenizer("tok-a", 10, 4, [0.05, 0.5], {FinishReason.STOP: 2}), now)
    board.on_snapshot(tokenizer("tok-b", 7, 3, [2.0], {FinishReason.LENGTH: 1}), now)
    board.on_snapshot(tokenizer("tok-a", 12, 6, [0.05, 0.5, 0.7], {FinishReason.STOP: 3}), now)  # newer: replaces
    # replica 0 ran, died (its source falls silent) and came back as a new source; replica 1 is live
    board.on_snapshot(engine("e0-old", "0", running=5, used_blocks=50, preemptions=2, iteration_tokens=[5, 1]),
                      now - STALE_S - 1)
    board.on_snapshot(engine("e0-new", "0", running=1, used_blocks=10, preemptions=1, iteration_tokens=[3]), now)
    board.on_snapshot(engine("e1", "1", running=2, used_blocks=25, preemptions=0, iteration_tokens=[9, 1, 1]), now)
    board.on_snapshot(AdmissionMetrics("adm", 4, 100, 20, 2, 1), now)

    m = parse(render_system_metrics(board, "demo", now))

    assert m[("vllm:prompt_tokens_total", (("model_name", "demo"),))] == 12 + 7
    assert m[("vllm:generation_tokens_total", (("model_name", "demo"),))] == 6 + 3
    assert m[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "demo")))] == 3
    assert m[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "demo")))] == 1
    ttft = (("model_name", "demo"),)
    assert m[("vllm:time_to_first_token_seconds_count", ttft)] == 4
    assert m[("vllm:time_to_first_token_seconds_sum", ttft)] == pytest.approx(0.05 + 0.5 + 0.7 + 2.0)
    assert m[("vllm:time_to_first_token_seconds_bucket", (("le", "0.1"), ("model_name", "demo")))] == 1
    assert m[("vllm:time_to_first_token_seconds_bucket", (("le", "0.5"), ("model_name", "demo")))] == 2
    assert m[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"), ("model_name", "demo")))] == 4

    e0, e1 = (("engine", "0"), ("model_name", "demo")), (("engine", "1"), ("model_name", "demo"))
    # counters: the dead incarnation's count stays in (a restart adds, never resets)
    assert m[("vllm:num_preemptions_total", e0)] == 3 and m[("vllm:num_preemptions_total", e1)] == 0
    assert m[("vllm:iteration_tokens_total_sum", e0)] == 9 and m[("vllm:iteration_tokens_total_count", e0)] == 3
    assert m[("orca:iterations_total", e1)] == 3
    # gauges: only the live incarnation
    assert m[("vllm:num_requests_running", e0)] == 1 and m[("vllm:num_requests_running", e1)] == 2
    assert m[("vllm:kv_cache_usage_perc", e0)] == 0.10 and m[("vllm:gpu_cache_usage_perc", e1)] == 0.25
    assert m[("orca:kv_reserved_slots", e1)] == 400 and m[("orca:kv_used_slots", e1)] == 250
    assert m[("vllm:num_requests_waiting", (("engine", "admission"), ("model_name", "demo")))] == 4
    assert m[("orca:admission_rejections_total", (("reason", "queue_full"),))] == 2
    assert m[("orca:admission_rejections_total", (("reason", "unservable"),))] == 1
    assert m[("orca:metrics_sources", (("kind", "engine"),))] == 2
    assert m[("orca:metrics_sources", (("kind", "tokenizer"),))] == 2


def test_histogram_buckets_are_le():
    h = Histogram((1, 2))
    for v in (0.5, 1, 1.5, 2, 3):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.sum == 8.0


def test_snapshots_travel_over_nats_to_the_board(nats_url):
    async def main():
        board = MetricsBoard()
        listener, producer = await nats.connect(nats_url), await nats.connect(nats_url)
        await listener.subscribe(subjects.METRICS, cb=board.on_message)
        await listener.flush()
        count = {"n": 0}

        def snapshot():
            count["n"] += 1
            return AdmissionMetrics("adm-x", count["n"], 10, 0, 0, 0)

        publisher = SnapshotPublisher(producer, snapshot, interval_s=0.05)
        publisher.start()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if board.sources.get("adm-x") and board.sources["adm-x"][0].queue_len >= 3:
                break
        await publisher.stop()
        await producer.publish(subjects.METRICS, b"not msgpack")  # a bad message is logged, not fatal
        await producer.publish(subjects.METRICS, Codec.encode(AdmissionMetrics("adm-y", 1, 10, 0, 0, 0)))
        await producer.flush()
        for _ in range(200):  # waits for delivery, not a fixed time: the unit tests run at nice 19 in CI
            if "adm-y" in board.sources:
                break
            await asyncio.sleep(0.05)
        await listener.close()
        await producer.close()
        return board

    board = asyncio.run(main())
    assert board.sources["adm-x"][0].queue_len >= 3  # it kept publishing, newest kept
    assert set(board.sources) == {"adm-x", "adm-y"}


def test_every_publisher_follows_the_metrics_interval_and_the_board_waits_three_of_them(monkeypatch):
    """ORCA_METRICS_INTERVAL_S reaches the tokenizer's and admission's publishers (not only the engine's),
    and a gauge stays on /metrics for three intervals: at 6 s, not gone on every sixth scrape."""
    from services.admission.service import AdmissionService
    from services.tokenizer.service import TokenizerService
    from tests.fake_nats import RecordingNats
    from tests.reliability.test_recovery_shells import FakeTokenizer

    monkeypatch.setenv("ORCA_METRICS_INTERVAL_S", "6")
    nc = RecordingNats()
    assert TokenizerService(nc, FakeTokenizer(), vocab_size=10).metrics.interval_s == 6.0
    assert AdmissionService(nc, max_queue_len=4).metrics.interval_s == 6.0
    board, now = MetricsBoard(), 1000.0
    assert board.stale_s == 18.0
    board.on_snapshot(engine("e0", "0", running=1, used_blocks=1, preemptions=0, iteration_tokens=[1]), now - 7)
    assert [e.replica for e in board.live_engines(now)] == ["0"]
    monkeypatch.delenv("ORCA_METRICS_INTERVAL_S")
    assert MetricsBoard().stale_s == STALE_S and SnapshotPublisher(nc, lambda: None).interval_s == 1.0


def test_vllms_request_level_families_add_up_and_an_older_snapshot_without_them_still_counts():
    """vLLM's request phases, per-request token counts and prefix-cache counters, summed over processes; a
    snapshot from a process of the version before (no such fields: msgspec fills the defaults) decodes,
    keeps its other figures and adds nothing to those families."""
    import msgspec

    old = engine("e-old", "0", running=0, used_blocks=0, preemptions=1, iteration_tokens=[4])
    before = EngineMetrics.__struct_fields__[:EngineMetrics.__struct_fields__.index("batch_size") + 1]
    fields = {f: getattr(old, f) for f in before}
    older = Codec.encode(msgspec.defstruct("EngineMetrics", [(f, object) for f in fields], tag="engine")(**fields))
    new = msgspec.structs.replace(
        engine("e-new", "0", running=0, used_blocks=0, preemptions=0, iteration_tokens=[4]),
        request_phases=RequestPhases(hist(LATENCY_BUCKETS, [0.2, 0.4]), hist(LATENCY_BUCKETS, [1.0, 3.0]),
                                     hist(LATENCY_BUCKETS, [1.2, 3.4]), hist(ITL_BUCKETS, [0.02])),
        prefix_cache_queries=40, prefix_cache_hits=16)
    served = msgspec.structs.replace(tokenizer("tok", 30, 9, [0.1, 0.1], {FinishReason.LENGTH: 2}),
                                     request_sizes=RequestSizes(hist(TOKEN_COUNT_BUCKETS, [10, 20]),
                                                                hist(TOKEN_COUNT_BUCKETS, [4, 5]),
                                                                hist(TOKEN_COUNT_BUCKETS, [5])))
    board, now = MetricsBoard(), 1000.0
    asyncio.run(board.on_message(type("Msg", (), {"data": older})()))
    for snapshot in (new, served):
        board.on_snapshot(snapshot, now)
    assert board.sources["e-old"][0].prefix_cache_queries == 0 and board.sources["e-old"][0].request_phases is None
    m = parse(render_system_metrics(board, "demo", now))
    e0, model = (("engine", "0"), ("model_name", "demo")), (("model_name", "demo"),)
    assert m[("vllm:num_preemptions_total", e0)] == 1  # the older snapshot's figures still count
    assert m[("vllm:request_prefill_time_seconds_count", e0)] == 2
    assert m[("vllm:request_prefill_time_seconds_sum", e0)] == pytest.approx(0.6)
    one_second = (("engine", "0"), ("le", "1.0"), ("model_name", "demo"))
    assert m[("vllm:request_decode_time_seconds_bucket", one_second)] == 1
    assert m[("vllm:request_inference_time_seconds_sum", e0)] == pytest.approx(4.6)
    assert m[("vllm:request_time_per_output_token_seconds_count", e0)] == 1
    assert (m[("vllm:prefix_cache_queries_total", e0)], m[("vllm:prefix_cache_hits_total", e0)]) == (40, 16)
    assert m[("vllm:request_prompt_tokens_sum", model)] == 30 and m[("vllm:request_prompt_tokens_count", model)] == 2
    assert m[("vllm:request_prompt_tokens_bucket", (("le", "10.0"), ("model_name", "demo")))] == 1
    assert m[("vllm:request_generation_tokens_sum", model)] == 9
    assert m[("vllm:request_params_max_tokens_count", model)] == 1
