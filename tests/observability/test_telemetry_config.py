"""Tracing configured from OpenTelemetry's standard variables, as its users set them: the OTLP protocol
(gRPC, or HTTP to a collector's :4318 with the spec's /v1/traces rule), OTEL_TRACES_EXPORTER,
OTEL_SDK_DISABLED and OTEL_TRACES_SAMPLER; a value the SDK cannot honour is an error that names it."""

from __future__ import annotations

import pytest

from shared.telemetry import TelemetryConfig, _provider


def config(**env: str) -> TelemetryConfig:
    return TelemetryConfig.from_env(env)


def exporter_of(cfg: TelemetryConfig):
    provider = _provider("test", cfg)
    try:
        return provider._active_span_processor._span_processors[0].span_exporter
    finally:
        provider.shutdown()


def test_grpc_by_default_to_the_endpoint_given():
    cfg = config(OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4317")
    assert (cfg.exporter, cfg.otlp_protocol, cfg.otlp_endpoint) == ("otlp", "grpc", "http://collector:4317")
    assert type(exporter_of(cfg)).__module__.endswith("proto.grpc.trace_exporter")


@pytest.mark.parametrize("env,url", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://y:4318/custom/traces"}, "http://y:4318/custom/traces"),
])
def test_http_protobuf_goes_to_the_traces_url_over_http(env, url):
    cfg = config(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", **env)
    exporter = exporter_of(cfg)
    assert type(exporter).__module__.endswith("proto.http.trace_exporter")
    assert cfg.otlp_endpoint == url and exporter._endpoint == url


@pytest.mark.parametrize("env,exporter", [
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "none"),
    ({"OTEL_TRACES_EXPORTER": "console", "ORCA_TRACES_EXPORTER": "jsonl:/tmp/x.jsonl"}, "jsonl"),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "none"),
])
def test_the_standard_exporter_and_disable_switches(env, exporter):
    assert config(**env).exporter == exporter


@pytest.mark.parametrize("sampler,arg,ratio", [
    ("always_off", None, 0.0), ("parentbased_always_on", "0.1", 1.0), ("traceidratio", "0.25", 0.25),
    (None, "0.5", 0.5),
])
def test_the_sampler_variables(sampler, arg, ratio):
    env = {k: v for k, v in (("OTEL_TRACES_SAMPLER", sampler), ("OTEL_TRACES_SAMPLER_ARG", arg)) if v is not None}
    assert config(**env).sampler_ratio == ratio


@pytest.mark.parametrize("env,words", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http/json"),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "jaeger_remote"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin"),
])
def test_what_cannot_be_honoured_is_an_error_naming_it(env, words):
    with pytest.raises(ValueError, match=words):
        config(**env)
