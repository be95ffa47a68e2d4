"""Schemathesis against the live gateway's own /openapi.json: generated valid and invalid requests
(fixed seed, bounded examples) get no 5xx, a documented status and content type, and bodies that
match the documented response schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


def keep_it_small(body: object) -> None:
    """Keep generation cheap on a CPU: change only values the schema allows into other allowed ones
    (so an invalid body stays invalid), and give max_tokens where a default would be large."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and 2 < body["n"] <= 16:
        body["n"] = 2
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body and ("messages" in body or "prompt" in body):
        body["max_tokens"] = 4
    prompt = body.get("prompt")
    if isinstance(prompt, list) and 2 < len(prompt) <= 32 and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:2]


OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model_id}",
              "GET /health", "GET /metrics", "GET /version", "POST /tokenize", "POST /detokenize",
              "POST /v1/abort/{request_id}"]


WITH_BODY = {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"}


def test_the_api_matches_its_openapi_schema(gateway):
    # schemathesis' lazy pytest loader does not work with this pytest; its Python API drives Hypothesis here.
    api = schemathesis.openapi.from_url(gateway.http_url + "/openapi.json")
    operations = {op.label: op for op in (result.ok() for result in api.get_all_operations())}
    assert sorted(operations) == sorted(OPERATIONS), "every route is in the schema"
    calls = []
    for label in OPERATIONS:
        # Negative data needs input that can be invalid: a JSON body (path parameters are any string).
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if label in WITH_BODY else [])
        for mode in modes:
            run_examples(operations[label], mode, 12 if label.startswith("POST /v1") else 6, calls)
    codes = {code for _, _, code in calls}
    assert all(code < 500 for code in codes), calls
    assert len(calls) > 80 and {200, 400} <= codes, calls


def run_examples(operation, mode: GenerationMode, max_examples: int, calls: list) -> None:
    @given(operation.as_strategy(generation_mode=mode))
    @seed(20260601)
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    def check(case):
        keep_it_small(case.body)
        response = case.call_and_validate(checks=CHECKS, timeout=60)
        calls.append((operation.label, mode.value, response.status_code))
    check()
