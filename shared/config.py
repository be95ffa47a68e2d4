"""One typed, frozen engine configuration, checked once when it is built.

Each field declares its command-line flag beside it (`Flag`: help, and the names and choices where
they are not the field's own): shared/flags.py builds the flags from these declarations, shared/env.py
the ORCA_<FIELD> variables, so a new field is one line here. Flag names follow vLLM's where vLLM has
the same knob. Values only known at run time (the model's context length, EOS id, KV capacity in
blocks) are not written back here: they travel with the objects that find them.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

SCHEDULER_POLICIES = ("orca", "request-level", "paged", "static")
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag, declared with the field: `Annotated[int, Flag("...")]`.
    shared/flags.py builds the argparse flags from it, shared/env.py the ORCA_ variables."""

    help: str
    names: tuple[str, ...] = ()
    """Option strings where they are not `--field-name` (vLLM's `--scheduler`, `-tp`); the last is the long one."""
    choices: tuple[str, ...] | None = None


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: Annotated[str, Flag("iteration scheduling policy", names=("--scheduler",),
                                choices=SCHEDULER_POLICIES)] = "orca"
    """`orca`: iteration-level, FCFS, reserves prompt_len + max_tokens slots at admission.
    `request-level`: the paper's baseline; a batch forms only when the engine is idle.
    `paged`: blocks on demand, preemption by recompute when they run out (vLLM).
    `static`: FasterTransformer behind a request-level server (the paper's measured baseline):
    a fixed dense batch, finished requests keep computing until it ends (core.policies.StaticPolicy)."""
    max_num_seqs: Annotated[int, Flag("most requests running at once")] = 128
    """Most requests running (admitted) at once."""
    max_num_batched_tokens: Annotated[int | None, Flag("token budget of one iteration")] = None
    """Token budget of one iteration; None means max(max_model_len, 8192)."""
    enable_chunked_prefill: Annotated[bool, Flag("split long prompts across iterations")] = False
    """Split prompts that do not fit the remaining budget into chunks (Sarathi-Serve)."""
    long_prefill_token_threshold: Annotated[int, Flag("most tokens of one request's prefill chunk (0: no cap)")] = 0
    """vLLM's knob: with chunked prefill on, one request's prompt chunk in one iteration is at most this
    many tokens, so one long prompt does not take a whole iteration's budget from the decodes and
    shorter prompts beside it. 0: no cap (vLLM's default). Ignored without chunked prefill and under `static`."""
    async_scheduling: Annotated[bool, Flag(
        "schedule the next iteration while the worker runs this one (one worker; default on)")] = True
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
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0")


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_cache_tokens: Annotated[int, Flag("KV cache capacity in token slots")] = 65536
    """KV capacity in token slots, preallocated once at start-up (rounded down to whole blocks)."""
    block_size: Annotated[int, Flag("KV slots per block (1 = Orca's per-slot accounting)")] = 16
    """Slots per KV block: the unit of accounting. 1 gives Orca's exact per-slot reservation."""
    enable_prefix_caching: Annotated[bool, Flag("share KV of identical prompt prefixes")] = False
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
    model: Annotated[str, Flag("Hugging Face checkpoint directory")]
    """A Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer)."""
    dtype: Annotated[str, Flag("auto: float32 on CPU, bfloat16 on CUDA", choices=DTYPES)] = "auto"
    """`auto`: float32 on CPU, bfloat16 on CUDA."""
    device: Annotated[str, Flag("cpu or cuda[:N]")] = "cpu"
    """`cpu`, `cuda` or `cuda:N`."""
    max_model_len: Annotated[int | None, Flag("context length (default: the model's)")] = None
    """Context length; None means the checkpoint's max_position_embeddings."""
    seed: Annotated[int, Flag("seed for requests that give none")] = 0
    """Seed for requests that give none."""
    kernel_backend: Annotated[str, Flag(
        "auto: Triton kernels on CUDA, the compiled C attention on CPU (torch without a C compiler)",
        choices=KERNEL_BACKENDS)] = "auto"
    """`auto`: Triton kernels on CUDA; on CPU the compiled C attention kernel (torch where no C compiler
    is found); `torch` the plain torch path, the reference."""
    enforce_eager: Annotated[bool | None, Flag(
        "--enforce-eager: the plain torch step; --no-enforce-eager: compile it (torch.compile) on any device; "
        "default: compile on CUDA only")] = None
    """True: the plain torch step (debugging, float64 exactness). False: the step compiled with
    torch.compile (CUDA graphs for decode on CUDA). None: compiled where it pays, on CUDA; eager on CPU,
    where compiling measured no faster (benchmarks/README.md)."""
    chat_template: Annotated[str | None, Flag(
        "a Jinja chat template, as a file or the template text, rendered instead of the checkpoint's "
        "(vLLM's flag)")] = None
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
    tensor_parallel_size: Annotated[int, Flag("workers per pipeline stage",
                                              names=("-tp", "--tensor-parallel-size"))] = 1
    """Workers per pipeline stage; each holds 1/N of every layer's heads and MLP columns."""
    pipeline_parallel_size: Annotated[int, Flag("pipeline stages (as many batches in flight)",
                                                names=("-pp", "--pipeline-parallel-size"))] = 1
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


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the engines and services are run, as opposed to what the engine computes: taken by every
    launcher (`orca serve`, `python -m services.<name>`, the RayService builder), each with the flags of
    the fields it uses (shared/flags.py `add_serve_flags`), so each setting is declared here once."""

    replicas: Annotated[int, Flag("engine replicas (each with its own workers)")] = 1
    """Engine replicas, each a master with its tp x pp workers; admission routes across them."""
    worker_threads: Annotated[int | None, Flag(
        "torch threads per worker (default: the cores less one, shared by the workers)")] = None
    """Torch threads per worker; None: `orca serve` gives the workers the cores less one (the control
    plane's), the other launchers leave torch's default."""
    worker_cpus: Annotated[float, Flag(
        "Ray CPUs reserved per worker (tp x pp workers per replica; fractions allowed)")] = 1.0
    """Ray CPUs each worker reserves (placement only: threads are `worker_threads`)."""
    step_timeout: Annotated[float, Flag(
        "an engine iteration with no result within this many seconds counts as a dead worker")] = 120.0
    """Seconds an iteration may take before its worker counts as dead (restarted; its requests resume)."""
    hang_timeout: Annotated[float, Flag(
        "a service process or engine master that shows no sign of life this many seconds is killed and "
        "restarted")] = 10.0
    """Seconds a supervised process (service or engine master) may stay silent before it is killed and restarted."""
    drain_timeout: Annotated[float, Flag(
        "on SIGTERM, seconds to let requests in flight finish before ending them with an error")] = 30.0
    """On SIGTERM, how long the tokenizer and jobs services let requests in flight finish."""
    max_queue_len: Annotated[int, Flag("admission queue bound (requests waiting beyond it are refused)")] = 1024
    """Requests admission holds waiting; one more is refused at once (HTTP 429 with Retry-After)."""
    startup_timeout: Annotated[float, Flag("seconds `orca serve` waits for its engines and tokenizer")] = 300.0
    """How long `orca serve` waits for every engine to be ready and a tokenizer to answer."""
    jobs_ack_wait: Annotated[float, Flag(
        "seconds a jobs consumer that stopped sending heartbeats keeps its jobs before JetStream hands them "
        "to another")] = 30.0
    """JetStream's ack wait on the jobs consumer: a live consumer beats three times within it; a dead one's
    jobs go to another consumer this long after its last beat."""

    def __post_init__(self) -> None:
        for name in ("replicas", "max_queue_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"worker_threads={self.worker_threads} must be >= 1")
        for name in ("worker_cpus", "step_timeout", "hang_timeout", "startup_timeout", "jobs_ack_wait"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout={self.drain_timeout} must be >= 0")


@dataclass(frozen=True)
class ConfigField:
    """One field of a config struct with its flag: what shared/flags.py and shared/env.py derive the
    command line and the ORCA_ variables from."""

    section: str
    """Where the field lives: EngineConfig's attribute (model, scheduler, cache or parallel), or `serve`."""
    name: str
    type: Any
    """The annotation without its Flag: int, str, `int | None`, ..."""
    default: Any
    """msgspec.NODEFAULT where the field has none (ModelConfig.model)."""
    flag: Flag

    @property
    def option_strings(self) -> tuple[str, ...]:
        return self.flag.names or ("--" + self.name.replace("_", "-"),)

    @property
    def dest(self) -> str:
        """The argparse dest, from the long option: `scheduler` for policy."""
        return self.option_strings[-1].removeprefix("--").replace("-", "_")


def struct_fields(struct: type[msgspec.Struct], section: str) -> list[ConfigField]:
    """The fields of one config struct, in declaration order; a field without a Flag is a TypeError."""
    out = []
    for f in msgspec.structs.fields(struct):
        base, *meta = typing.get_args(f.type) if typing.get_origin(f.type) is Annotated else (f.type,)
        flags = [m for m in meta if isinstance(m, Flag)]
        if len(flags) != 1:
            raise TypeError(f"{struct.__name__}.{f.name} must be annotated with one Flag")
        out.append(ConfigField(section, f.name, base, f.default, flags[0]))
    return out


def engine_fields() -> list[ConfigField]:
    """Every field of every section of EngineConfig, in declaration order (field names are unique
    across sections, so one flag and one variable each)."""
    return [f for section in msgspec.structs.fields(EngineConfig) for f in struct_fields(section.type, section.name)]


def serve_fields() -> list[ConfigField]:
    """Every field of ServeConfig, in declaration order (no name shared with an engine field)."""
    return struct_fields(ServeConfig, "serve")
