"""Request arrival times, as `vllm bench serve` draws them.

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean 1/rate:
burstiness 1 is a Poisson process (exponential gaps), below 1 burstier, above 1 more
regular. A rate of inf sends everything at t=0. The first request arrives at t=0.
"""

from __future__ import annotations

import math

import numpy as np


def parse_rate(text: str) -> float:
    """'2.5' or 'inf' -> requests per second; ValueError for anything not > 0."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"request rate {text!r} must be a number or 'inf'") from None
    if not rate > 0:
        raise ValueError(f"request rate {text!r} must be > 0")
    return rate


def parse_rates(text: str) -> list[float]:
    """A comma list of rates, e.g. '0.5,1,2,inf', sorted ascending (a ramp)."""
    rates = [parse_rate(part.strip()) for part in text.split(",") if part.strip()]
    if not rates:
        raise ValueError(f"--sweep {text!r} names no rates")
    return sorted(set(rates))


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent, non-decreasing."""
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} must be >= 0")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness={burstiness} must be a finite number > 0")
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} must be > 0")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
