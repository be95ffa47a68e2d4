"""The gateway's own token counters (orca:prompt_tokens_total, orca:completion_tokens_total), on the
in-memory gateway: both count the choices that reached an engine, whether they finished, failed or
were cut off by their client; a request refused before any token counts neither."""

from __future__ import annotations

from tests.gateway.fakes import fake_gateway


def counts(http) -> dict:
    return dict(http.app.state.gateway.tokens)


def test_a_served_request_counts_its_prompt_per_choice_and_every_token():
    http, _, _ = fake_gateway(lambda request: ["ab", "c"])
    assert http.post("/v1/completions", json={"prompt": "hey", "n": 2, "max_tokens": 3}).status_code == 200
    assert counts(http) == {"prompt": 6, "completion": 6}


def test_a_request_refused_before_any_token_counts_nothing():
    http, _, _ = fake_gateway(lambda request: [""], finish_reason="error")
    assert http.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3}).status_code == 503
    assert counts(http).get("prompt", 0) == counts(http).get("completion", 0) == 0


def test_a_stream_that_fails_after_its_first_tokens_counts_them():
    http, _, _ = fake_gateway(lambda request: ["ab", ""], finish_reason="error")
    with http.stream("POST", "/v1/completions", json={"prompt": "hey", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and any('"error"' in line for line in r.iter_lines())
    assert counts(http) == {"prompt": 3, "completion": 2}
