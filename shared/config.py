"""One typed, frozen engine configuration, checked once when it is built.

Flag names follow vLLM's where vLLM has the same knob. Values only known at run time
(the model's context length, EOS id, KV capacity in blocks) are not written back here:
they travel with the objects that find them.
"""

from __future__ import annotations

import msgspec

SCHEDULER_POLICIES = ("orca", "request-level", "paged", "static")
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: str = "orca"
    """`orca`: iteration-level, FCFS, reserves prompt_len + max_tokens slots at admission.
    `request-level`: the paper's baseline; a batch forms only when the engine is idle.
    `paged`: blocks on demand, preemption by recompute when they run out (vLLM).
    `static`: FasterTransformer behind a request-level server (the paper's measured baseline):
    a fixed dense batch, finished requests keep computing until it ends (core.policies.StaticPolicy)."""
    max_num_seqs: int = 128
    """Most requests running (admitted) at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one iteration; None means max(max_model_len, 8192)."""
    enable_chunked_prefill: bool = False
    """Split prompts that do not fit the remaining budget into chunks (Sarathi-Serve)."""
    async_scheduling: bool = True
    """Schedule iteration N+1 while the worker runs N (vLLM V1's async scheduling): the worker feeds
    back the tokens it samples itself, so the engine's control round trip leaves the critical path.
    Applies with one worker and an iteration-level policy; ignored under -tp/-pp and `static`."""

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler policy {self.policy!r} is not one of {SCHEDULER_POLICIES}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_cache_tokens: int = 65536
    """KV capacity in token slots, preallocated once at start-up (rounded down to whole blocks)."""
    block_size: int = 16
    """Slots per KV block: the unit of accounting. 1 gives Orca's exact per-slot reservation."""
    enable_prefix_caching: bool = False
    """Share the KV of identical full-block prefixes across requests (refcounted, LRU eviction)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} must hold at least one block of {self.block_size}"
            )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    """A Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer)."""
    dtype: str = "auto"
    """`auto`: float32 on CPU, bfloat16 on CUDA."""
    device: str = "cpu"
    max_model_len: int | None = None
    """Context length; None means the checkpoint's max_position_embeddings."""
    seed: int = 0
    """Seed for requests that give none."""
    kernel_backend: str = "auto"
    """`auto`: Triton kernels on CUDA; on CPU the compiled C attention kernel (torch where no C compiler
    is found); `torch` the plain torch path, the reference."""
    enforce_eager: bool | None = None
    """True: the plain torch step (debugging, float64 exactness). False: the step compiled with
    torch.compile (CUDA graphs for decode on CUDA). None: compiled where it pays, on CUDA; eager on CPU,
    where compiling measured no faster (benchmarks/README.md)."""
    chat_template: str | None = None
    """vLLM's --chat-template: a Jinja file, or the template text, rendered for chat messages instead
    of the checkpoint's template (or where it has none). Read where a tokenizer loads
    (engine/tokenizer.py load_chat_template), so a path names a file on that machine."""

    def __post_init__(self) -> None:
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template is empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend {self.kernel_backend!r} is not one of {KERNEL_BACKENDS}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} must be 'cpu' or 'cuda[:N]'")


class ParallelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tensor_parallel_size: int = 1
    """Workers per pipeline stage; each holds 1/N of every layer's heads and MLP columns."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; each holds a contiguous slice of the layers and their KV cache. The engine
    keeps this many batches in flight, each with different requests (Orca's schedule)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} and pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    parallel: ParallelConfig = ParallelConfig()
