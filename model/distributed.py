"""A worker's torch.distributed groups in a tensor x pipeline parallel engine.

Ranks (`shared/parallel.py`) are laid out stage by stage: rank = pp_rank * tp_size + tp_rank. Tensor parallel peers
(one stage) all-reduce after each row-parallel projection; pipeline neighbours (same tp_rank,
adjacent stages) pass the hidden states and residual forward. Only tensors travel here;
control messages (steps, results) travel over NATS or the in-process executor's queues.
NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.parallel import ParallelRank


@dataclass
class ParallelGroups:
    """A worker's rank plus its live process groups (None when it works alone)."""

    rank: ParallelRank = field(default_factory=ParallelRank)
    tp_group: dist.ProcessGroup | None = None
    recv_wait_s: float = 0.0
    """Time spent waiting for the previous stage: this stage's share of the pipeline's bubbles."""
    _pending_sends: deque = field(default_factory=deque)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def send_to_next_stage(self, tensor: torch.Tensor) -> None:
        """Asynchronous, so this stage can start the next batch while the next stage works;
        the tensor is kept alive until the transfer completes."""
        while self._pending_sends and self._pending_sends[0][0].is_completed():
            self._pending_sends.popleft()
        work = dist.isend(tensor.contiguous(), dst=self.rank.rank + self.rank.tp_size)
        self._pending_sends.append((work, tensor))

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype,
                                 device: torch.device) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        dist.recv(buffer, src=self.rank.rank - self.rank.tp_size)
        self.recv_wait_s += time.perf_counter() - start
        return buffer


def init_distributed(rank: ParallelRank, init_method: str, device: str, timeout_s: float = 300.0) -> ParallelGroups:
    """Join the engine's process group and build the tensor-parallel group of this stage.
    Every rank creates every stage's group, in the same order, as torch.distributed requires."""
    if rank.world_size == 1:
        return ParallelGroups(rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init_method, rank=rank.rank, world_size=rank.world_size,
                            timeout=timedelta(seconds=timeout_s))
    tp_group = None
    for stage in range(rank.pp_size):
        group = dist.new_group([stage * rank.tp_size + t for t in range(rank.tp_size)])
        if stage == rank.pp_rank:
            tp_group = group
    return ParallelGroups(rank, tp_group if rank.tp_size > 1 else None)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
