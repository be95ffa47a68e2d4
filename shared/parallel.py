"""Where one worker sits in a tensor x pipeline parallel engine: rank arithmetic, no torch.

Ranks are laid out stage by stage: rank = pp_rank * tp_size + tp_rank. The control plane (the engine
master's actor, which starts the workers) needs this without importing torch; the torch side
(`model/distributed.py`) builds the process groups from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelRank:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @staticmethod
    def of(rank: int, tp_size: int, pp_size: int) -> ParallelRank:
        return ParallelRank(rank % tp_size, tp_size, rank // tp_size, pp_size)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The one worker that samples and answers the step (last stage, first TP rank)."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This stage's contiguous slice of the layers; earlier stages take the remainder."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size={self.pp_size} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (1 if self.pp_rank < extra else 0)
