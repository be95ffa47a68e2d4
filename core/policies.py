"""Admission policies: when a waiting request may join, and how much KV it reserves.

Each policy is a small object; the scheduler asks it two questions and never branches
on a policy's name.
"""

from __future__ import annotations

from typing import Protocol

from core.request import Request


class AdmissionPolicy(Protocol):
    name: str
    grows_on_demand: bool
    """True: blocks are allocated as tokens come, and running requests may be preempted."""

    def admission_open(self, num_running_at_start: int) -> bool:
        """May requests be admitted in this iteration?"""
        ...

    def reservation(self, request: Request, max_model_len: int) -> int:
        """KV slots to reserve at admission; the request never needs more."""
        ...


class OrcaPolicy:
    """Orca (OSDI '22): iteration-level; admits whenever prompt_len + max_tokens slots fit."""

    name = "orca"
    grows_on_demand = False

    def admission_open(self, num_running_at_start: int) -> bool:
        return True

    def reservation(self, request: Request, max_model_len: int) -> int:
        return min(request.max_total_tokens, max_model_len)


class RequestLevelPolicy(OrcaPolicy):
    """The paper's baseline: a batch forms only when the engine is idle, and runs until
    all of its members finish; nobody joins a running batch."""

    name = "request-level"

    def admission_open(self, num_running_at_start: int) -> bool:
        return num_running_at_start == 0


class PagedPolicy:
    """vLLM's answer to Orca's reservation: admit when the prompt's blocks fit, grow block by
    block as tokens come, and when blocks run out preempt by recompute (the victim's blocks
    are freed, it goes back to the waiting queue with its generated tokens kept)."""

    name = "paged"
    grows_on_demand = True

    def admission_open(self, num_running_at_start: int) -> bool:
        return True

    def reservation(self, request: Request, max_model_len: int) -> int:
        return request.num_tokens


POLICIES: dict[str, type] = {
    OrcaPolicy.name: OrcaPolicy,
    RequestLevelPolicy.name: RequestLevelPolicy,
    PagedPolicy.name: PagedPolicy,
}


def make_policy(name: str) -> AdmissionPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduler policy {name!r} is not one of {sorted(POLICIES)}")
    return POLICIES[name]()
