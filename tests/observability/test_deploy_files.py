"""deploy/observability: the alert rules and the Prometheus config pass promtool (and the alerts'
own unit tests fire as they should), every dashboard query parses as PromQL and reads only metrics
the gateway serves, and the collector and Grafana provisioning files hang together."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import types
from collections import Counter
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import MetricsBoard, render_gateway_metrics, render_system_metrics
from shared.messages import AdmissionMetrics, EngineMetrics, HistogramData, TokenizerMetrics
from shared.telemetry import (BATCH_SIZE_BUCKETS, ITERATION_TOKEN_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS,
                              TTFT_BUCKETS)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
PROMTOOL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orca-serve" / "promtool"


@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool from PATH, or from Debian's prometheus package (downloaded once, unpacked, cached)."""
    found = shutil.which("promtool") or next(iter(PROMTOOL_CACHE.glob("usr/bin/promtool")), None)
    if found is None and shutil.which("apt-get") and shutil.which("dpkg-deb"):
        PROMTOOL_CACHE.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["apt-get", "download", "prometheus"], cwd=PROMTOOL_CACHE, check=True,
                           capture_output=True, timeout=180)
            deb = next(PROMTOOL_CACHE.glob("prometheus_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(PROMTOOL_CACHE)], check=True, timeout=120)
        except (subprocess.SubprocessError, StopIteration, OSError) as exc:
            pytest.skip(f"promtool is not installed and Debian's prometheus package could not be fetched: {exc}")
        found = next(iter(PROMTOOL_CACHE.glob("usr/bin/promtool")), None)
    if found is None:
        pytest.skip("promtool is not installed and apt-get/dpkg-deb are not available to fetch it")
    return str(found)


def run(promtool: str, *args: str, cwd: Path = DEPLOY) -> str:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_alert_rules_pass_promtool_and_their_unit_tests(promtool):
    assert "SUCCESS: 5 rules found" in run(promtool, "check", "rules", "alerts.yml")
    run(promtool, "test", "rules", "alerts_test.yml")
    run(promtool, "check", "config", "prometheus.yml")  # also loads alerts.yml through rule_files
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == ["gateway:8000"] and job["metrics_path"] == "/metrics"
    alerts = {r["alert"]: r["expr"] for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
              for r in g["rules"]}
    assert "vllm:kv_cache_usage_perc" in alerts["OrcaKVCacheNearlyFull"]
    assert "vllm:gpu_cache_usage_perc" in alerts["OrcaKVCacheNearlyFull"]


def dashboard_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "orca.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    # Grafana's variables, as Grafana would substitute them
    return [e.replace("$__rate_interval", "1m").replace("$model_name", ".*") for e in exprs]


def test_dashboard_queries_are_valid_promql(promtool, tmp_path):
    """promtool parses every query (as recording rules: it has no other way to check an expression)."""
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                       for i, e in enumerate(dashboard_queries())]}]}
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump(rules))
    run(promtool, "check", "rules", "dashboard_rules.yml", cwd=tmp_path)


def served_sample_names() -> set[str]:
    """Every sample name the gateway's /metrics serves once each kind of process has reported."""
    def hist(bounds):
        return HistogramData([0] * (len(bounds) + 1), 0.0)

    board = MetricsBoard()
    board.on_snapshot(TokenizerMetrics("t", 1, 1, {}, hist(TTFT_BUCKETS), hist(ITL_BUCKETS), hist(LATENCY_BUCKETS), 0))
    board.on_snapshot(AdmissionMetrics("a", 0, 10, 0, 0, 0))
    board.on_snapshot(EngineMetrics("e", "0", "orca", 0, 0, 8, 10, 16, 0, 0, 0, 0, 0, hist(LATENCY_BUCKETS),
                                    hist(ITERATION_TOKEN_BUCKETS), hist(BATCH_SIZE_BUCKETS)))
    # the gateway's own part reads only these attributes of its state
    status = types.SimpleNamespace(fresh_admission=lambda: None, num_engines_ready=1)
    state = types.SimpleNamespace(client=types.SimpleNamespace(status=status, num_running=0),
                                  http_requests=Counter({("/v1/completions", 200): 1}),
                                  tokens=Counter({"prompt": 1, "completion": 1}))
    text = render_gateway_metrics(state) + render_system_metrics(board, "demo")
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_dashboard_and_alerts_read_only_served_metrics():
    served = served_sample_names()
    alerts = [r["expr"] for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    used = {m for text in [*dashboard_queries(), *alerts] for m in re.findall(r"\b(?:vllm|orca):[a-z0-9_]+", text)}
    assert used - served == set(), f"queried but never served: {sorted(used - served)}"
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket", "vllm:iteration_tokens_total_bucket",
            "vllm:request_success_total", "orca:batch_size_bucket", "orca:kv_reserved_slots", "orca:kv_used_slots",
            "orca:admission_rejections_total", "orca:http_requests_total", "vllm:request_prefill_time_seconds_bucket",
            "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
            "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_prompt_tokens_bucket",
            "vllm:request_generation_tokens_bucket", "vllm:request_params_max_tokens_bucket",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= served


def test_grafana_provisioning_and_collector_config_hang_together():
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"]: d for d in datasources["datasources"]}
    assert uids["prometheus"]["url"] == "http://prometheus:9090" and uids["prometheus"]["type"] == "prometheus"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/orca.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"prometheus"}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/orca.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]

    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert "debug" in collector["exporters"]
    assert set(collector["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(collector[kind]), kind
    assert set(collector["service"]["pipelines"]["traces"]["exporters"]) == {"otlp/jaeger", "debug"}
