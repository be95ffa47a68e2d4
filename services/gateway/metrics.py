"""GET /metrics: what this gateway can count itself, in Prometheus' text format, named `orca:...`
(vLLM's style). The engine-side metric set comes from the engines, not from here."""

from __future__ import annotations

from services.gateway.state import GatewayState


def render_metrics(state: GatewayState) -> str:
    status = state.client.status
    admission = status.fresh_admission()
    lines = [
        "# HELP orca:http_requests_total HTTP responses of this gateway by route and status code.",
        "# TYPE orca:http_requests_total counter",
    ]
    for (route, code), count in sorted(state.http_requests.items()):
        lines.append(f'orca:http_requests_total{{route="{_escape(route)}",code="{code}"}} {count}')
    gauges = [
        ("orca:num_requests_running", "Generation requests this gateway is waiting on.", state.client.num_running),
        ("orca:admission_queue_len", "Requests waiting in the admission queue (-1: no recent status).",
         admission.queue_len if admission else -1),
        ("orca:admission_max_queue_len", "The admission queue's bound (-1: no recent status).",
         admission.max_queue_len if admission else -1),
        ("orca:num_engines_ready", "Engine replicas the admission scheduler counts as ready.",
         status.num_engines_ready),
    ]
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    for kind in ("prompt", "completion"):
        name = f"orca:{kind}_tokens_total"
        lines += [f"# HELP {name} {kind.capitalize()} tokens of the requests this gateway served.",
                  f"# TYPE {name} counter", f"{name} {state.tokens[kind]}"]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
