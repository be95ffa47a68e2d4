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
    lockstep: bool
    """True: the running batch is one fixed, dense batch (see `StaticPolicy`): all of it runs in
    every iteration, one token per lane after the first, and finished requests keep their lane
    until the whole batch ends."""

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
    lockstep = False

    def admission_open(self, num_running_at_start: int) -> bool:
        return True

    def reservation(self, request: Request, max_model_len: int) -> int:
        return request.peak_tokens(max_model_len)


class RequestLevelPolicy(OrcaPolicy):
    """The paper's baseline: a batch forms only when the engine is idle, and runs until
    all of its members finish; nobody joins a running batch."""

    name = "request-level"

    def admission_open(self, num_running_at_start: int) -> bool:
        return num_running_at_start == 0


class PagedPolicy(OrcaPolicy):
    """vLLM's answer to Orca's reservation: iteration-level as Orca, but a request is admitted when
    its prompt's blocks fit, grows block by block as tokens come, and when blocks run out the
    scheduler preempts by recompute (the victim's blocks are freed, it goes back to the waiting
    queue with its generated tokens kept)."""

    name = "paged"
    grows_on_demand = True

    def reservation(self, request: Request, max_model_len: int) -> int:
        return request.num_tokens


class StaticPolicy(RequestLevelPolicy):
    """FasterTransformer behind a request-level server, the Orca paper's baseline as its section 6
    describes it (Yu et al., OSDI '22):
    - a batch is made of at most max_num_seqs requests taken from the queue when the previous
      batch has ended (Triton's dynamic batcher, section 6.2), and is fixed from then on;
    - every lane preallocates KV for the model's whole context, whatever its request needs
      (section 6.1: FasterTransformer's "fixed amount of memory pre-allocation for each request");
    - the first iteration processes every lane "as if they all had the same input length as the
      shortest one" (section 6.2); after that every lane computes one token per iteration: the rest
      of a longer prompt, a sampled token, or, once its request has finished, a wasted token;
    - "early-finished requests cannot immediately return to the clients" (section 6.2): a finished
      request keeps its lane and its KV, and every request's output returns when the batch ends.
    One pipeline micro-batch per batch (FasterTransformer's microbatch size = max batch size, the
    configurations the paper found best: (1, 1) and (8, 8)), so pipeline stages take turns."""

    name = "static"
    lockstep = True

    def reservation(self, request: Request, max_model_len: int) -> int:
        return max_model_len


POLICIES: dict[str, type] = {
    OrcaPolicy.name: OrcaPolicy,
    RequestLevelPolicy.name: RequestLevelPolicy,
    PagedPolicy.name: PagedPolicy,
    StaticPolicy.name: StaticPolicy,
}


def make_policy(name: str) -> AdmissionPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduler policy {name!r} is not one of {sorted(POLICIES)}")
    return POLICIES[name]()
