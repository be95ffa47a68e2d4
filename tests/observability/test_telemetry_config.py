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


@pytest.mark.parametrize("env,field,value,words", [
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     "otlp_protocol", "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_jaeger_remote", "OTEL_TRACES_SAMPLER_ARG": "0.5"}, "sampler_ratio", 0.5,
     "OTEL_TRACES_SAMPLER=parentbased_jaeger_remote"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "exporter", "none", "zipkin"),
    ({"OTEL_TRACES_EXPORTER": "otlp,zipkin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "exporter", "otlp",
     "zipkin"),
])
def test_a_standard_value_this_sdk_lacks_is_a_warning_and_a_fallback_not_a_failed_start(env, field, value, words,
                                                                                         caplog):
    """The OTel Operator and the like set these for every container: none of them may stop a service."""
    assert getattr(config(**env), field) == value
    assert words in caplog.text


@pytest.mark.parametrize("protocol,endpoint", [("grpc", "http://localhost:4317"),
                                               ("http/protobuf", "http://localhost:4318/v1/traces")])
def test_otlp_without_an_endpoint_goes_to_the_specifications_default(protocol, endpoint):
    cfg = config(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
    assert (cfg.exporter, cfg.otlp_endpoint) == ("otlp", endpoint)


def test_orca_s_own_exporter_setting_is_still_checked():
    with pytest.raises(ValueError, match="traces exporter 'zipkin'"):
        config(ORCA_TRACES_EXPORTER="zipkin")
