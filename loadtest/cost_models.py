"""Cost models for `orca simulate`: how long one iteration takes, given its batch.

An iteration is what `Scheduler.schedule()` returns: some prompt tokens (prefills) and some
single decode tokens, each request attending to its own context. `IterationShape` is that
batch reduced to the numbers a cost model needs; a cost model maps it to seconds. Under the
static policy (FasterTransformer) the batch also holds dead lanes, finished requests that
compute a wasted token each until their batch ends: they are decodes like any other (tokens,
weight reads, attention over the lane's context), counted apart in `dead_tokens` as well, and
the batch is one pipeline micro-batch (`pipelined=False`).

Two models ship:
- `this-machine`: this engine (in process, tiny demo model, this CPU), a linear model fitted
  from timed iterations by `benchmarks/fit_cost_model.py` (coefficients in `loadtest/fitted.py`).
- `gpt3-175b-a100-tp8pp2`: GPT-3 175B on 16 A100-40GB, tensor parallel 8 inside a node and
  pipeline parallel 2 across two nodes, as in the Orca paper's 175B experiment; derived from
  public figures (FLOPs, HBM bandwidth, NVLink and InfiniBand), see `ClusterCostModel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from core.batch import SchedulerOutput


@dataclass(frozen=True)
class IterationShape:
    """The work of one request in an iteration, or (summed) of a whole batch."""

    num_requests: int
    prefill_tokens: int
    """Prompt tokens computed this iteration (a whole prompt, or a chunk)."""
    decode_tokens: int
    """One token for a request past its prompt."""
    decode_context: int
    """KV entries the decode tokens attend to: the sum of their requests' context lengths."""
    prefill_attention: int
    """(query, key) pairs of the prefill tokens: a prompt of L tokens from scratch has L(L+1)/2."""
    dead_tokens: int = 0
    """Of the tokens above, those computed by dead lanes of a static batch (wasted work)."""

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def __add__(self, other: IterationShape) -> IterationShape:
        return IterationShape(self.num_requests + other.num_requests, self.prefill_tokens + other.prefill_tokens,
                              self.decode_tokens + other.decode_tokens, self.decode_context + other.decode_context,
                              self.prefill_attention + other.prefill_attention, self.dead_tokens + other.dead_tokens)


EMPTY = IterationShape(0, 0, 0, 0, 0)


def total(shapes: Iterable[IterationShape]) -> IterationShape:
    return sum(shapes, EMPTY)


def iteration_shapes(output: SchedulerOutput, prompt_lens: Mapping[str, int]) -> list[IterationShape]:
    """Each scheduled request's work, in batch order; `prompt_lens` maps request id -> prompt length.
    A dead lane's token is a decode at the lane's position (it attends to the lane's whole KV)."""
    shapes = []
    dead = set(output.dead_request_ids)
    for item in output.scheduled:
        start, new = item.num_computed_tokens, item.num_new_tokens
        wasted = new if item.request_id in dead else 0
        if start < prompt_lens[item.request_id]:
            shapes.append(IterationShape(1, new, 0, 0, new * start + new * (new + 1) // 2, wasted))
        else:
            shapes.append(IterationShape(1, 0, new, start + new, 0, wasted))
    return shapes


def partition(shapes: list[IterationShape], parts: int) -> list[IterationShape]:
    """Split a batch into `parts` micro-batches balanced by tokens (largest request first into
    the lightest micro-batch); returns each micro-batch's summed shape."""
    groups = [EMPTY] * parts
    for shape in sorted(shapes, key=lambda s: s.tokens, reverse=True):
        lightest = min(range(parts), key=lambda i: groups[i].tokens)
        groups[lightest] = groups[lightest] + shape
    return groups


@dataclass(frozen=True)
class LinearCostModel:
    """seconds = a + b * prefill_tokens + c * decode_tokens + d * decode_context (+ e * prefill_attention)."""

    name: str
    a: float
    """Seconds per iteration whatever it holds (launch, scheduling, sampling)."""
    b: float
    """Seconds per prefill token (the token-wise ops)."""
    c: float
    """Seconds per decode token."""
    d: float
    """Seconds per token of context a decode reads (attention over its KV)."""
    e: float = 0.0
    """Seconds per (query, key) pair of prompt attention (benchmarks/fit_cost_model.py fits without it: 0)."""
    max_model_len: int = 1024
    """The context of the model it was fitted on."""
    default_kv_cache_tokens: int = 65536
    """The KV cache a simulation assumes when it is given none."""
    note: str = ""
    """How it was fitted and its held-out error (`benchmarks/fit_cost_model.py` writes it)."""

    def iteration_time(self, shapes: list[IterationShape], pipelined: bool = True) -> float:
        """`pipelined` is ignored: the model was fitted on one process."""
        shape = total(shapes)
        return (self.a + self.b * shape.prefill_tokens + self.c * shape.decode_tokens
                + self.d * shape.decode_context + self.e * shape.prefill_attention)


# ---- GPT-3 175B on A100s, from public figures -----------------------------------------------


@dataclass(frozen=True)
class TransformerSpec:
    """GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context
    2048), the largest model of the Orca paper's experiments (Yu et al., OSDI '22, section 6,
    the table of model configurations: 175B on 16 GPUs)."""

    params: float = 175e9
    layers: int = 96
    hidden: int = 12288
    bytes_per_value: int = 2
    """fp16 weights and KV, as FasterTransformer and Orca ran them."""
    max_model_len: int = 2048

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer: 2 * 96 * 12288 * 2 bytes = 4.7 MB per token."""
        return 2 * self.layers * self.hidden * self.bytes_per_value


@dataclass(frozen=True)
class GPUSpec:
    """NVIDIA A100 40GB SXM4 (NVIDIA A100 Tensor Core GPU datasheet): 312 TFLOP/s dense
    FP16/BF16 tensor math, 1,555 GB/s HBM2, 40 GB, third-generation NVLink 600 GB/s total
    (300 GB/s each way)."""

    peak_flops: float = 312e12
    hbm_bytes_per_s: float = 1.555e12
    memory_bytes: float = 40e9
    nvlink_bytes_per_s: float = 300e9


@dataclass(frozen=True)
class ClusterCostModel:
    """Iteration time of a TP x PP deployment, from FLOPs and bytes moved.

    Per GPU and pipeline stage, for a micro-batch (the iteration's batch split over the stages):
    - GEMMs: 2 * params FLOPs per token (Kaplan et al. 2020, "Scaling Laws", C_forward ~ 2N),
      against reading the stage's weight shard once: time = max(compute, weight read) (roofline).
    - attention: 4 * hidden FLOPs per (query, key) pair and layer (QK^T and AV), against reading
      the decode tokens' KV: time = max(compute, KV read).
    - tensor parallel: 2 all-reduces of (tokens, hidden) per layer in the forward pass
      (Shoeybi et al. 2019, Megatron-LM, the f/g operators), ring all-reduce moving
      2 (tp-1)/tp of the data over NVLink, plus a fixed latency per all-reduce.
    - pipeline parallel: the stage's activations cross to the next stage over InfiniBand;
      Megatron-LM's scatter/gather sends 1/tp of them over each of the node's 8 HDR links
      (Narayanan et al., SC '21, "Efficient Large-Scale Language Model Training on GPU Clusters
      Using Megatron-LM", section 4.1; the Orca testbed, Azure ND96asr A100 v4, has eight
      200 Gb/s HDR InfiniBand links per VM of 8 GPUs).
    - a fixed per-layer overhead for the ~dozen kernel launches and syncs of a layer.

    Pipelining, as Orca runs it: as many micro-batches in flight as there are stages. The
    scheduler here decides one batch per iteration, so an iteration is one round in which the
    batch, split into m = min(pp, requests) micro-batches balanced by tokens, crosses all pp
    stages and every request gains one token: round = pp * stage_time(heaviest micro-batch)
    (a micro-batch cannot start its next round before it has left the last stage). With m = pp
    equal micro-batches every stage is busy all round; with one request the stages take turns.
    Weight reads do not shrink with m (each micro-batch reads the stage's weights again), which is
    why pipelining helps compute-bound prefills and not weight-bound decodes.

    Efficiencies are assumptions, not measurements: Megatron-LM sustains 163 TFLOP/s per A100
    (52% of peak) on large GEMMs (Narayanan et al., SC '21, Table 1 / abstract); inference GEMMs of
    a few hundred tokens are smaller, so 0.5 is optimistic for decodes but those are
    bandwidth-bound anyway. HBM streaming reaches ~80% of peak; NCCL all-reduce on 8 A100s
    reaches ~230 GB/s bus bandwidth (nccl-tests on DGX A100) with ~15 us of latency for small
    messages.
    """

    name: str = "gpt3-175b-a100-tp8pp2"
    model: TransformerSpec = TransformerSpec()
    gpu: GPUSpec = GPUSpec()
    tp: int = 8
    pp: int = 2
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    allreduce_bus_bytes_per_s: float = 230e9
    allreduce_latency_s: float = 15e-6
    pp_link_bytes_per_s: float = 8 * 25e9
    """8 x 200 Gb/s HDR InfiniBand per node, used together by Megatron's scatter/gather."""
    pp_latency_s: float = 10e-6
    layer_overhead_s: float = 20e-6
    memory_reserve_fraction: float = 0.1
    """GPU memory kept for activations, workspace and the CUDA context."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.model.layers % self.pp:
            raise ValueError(f"tp={self.tp}, pp={self.pp}: need tp, pp >= 1 and pp dividing {self.model.layers} layers")
        if self.weights_per_gpu >= self.gpu.memory_bytes * (1 - self.memory_reserve_fraction):
            raise ValueError(f"tp={self.tp} x pp={self.pp}: the weights do not fit in GPU memory")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def weights_per_gpu(self) -> float:
        return self.model.weight_bytes / self.num_gpus

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def default_kv_cache_tokens(self) -> int:
        """KV slots that fit next to the weights: (40 GB * 0.9 - 21.9 GB) * 16 / 4.7 MB ~ 48k tokens."""
        free = self.gpu.memory_bytes * (1 - self.memory_reserve_fraction) - self.weights_per_gpu
        return int(free * self.num_gpus / self.model.kv_bytes_per_token)

    def stage_time(self, shape: IterationShape) -> float:
        """One micro-batch through one pipeline stage (layers / pp layers), on each of its tp GPUs."""
        m, gpu, shards = self.model, self.gpu, self.num_gpus
        flops_per_s = gpu.peak_flops * self.compute_efficiency
        bytes_per_s = gpu.hbm_bytes_per_s * self.memory_efficiency
        tokens = shape.prefill_tokens + shape.decode_tokens
        gemm = max(2 * m.params * tokens / shards / flops_per_s, self.weights_per_gpu / bytes_per_s)
        pairs = shape.decode_context + shape.prefill_attention
        attention = max(4 * m.hidden * m.layers * pairs / shards / flops_per_s,
                        m.kv_bytes_per_token * shape.decode_context / shards / bytes_per_s)
        layers = m.layers // self.pp
        activation_bytes = tokens * m.hidden * m.bytes_per_value
        allreduce = 0.0
        if self.tp > 1:
            ring = 2 * (self.tp - 1) / self.tp * activation_bytes / self.allreduce_bus_bytes_per_s
            allreduce = 2 * layers * (self.allreduce_latency_s + ring)
        send = self.pp_latency_s + activation_bytes / self.pp_link_bytes_per_s if self.pp > 1 else 0.0
        return gemm + attention + allreduce + send + layers * self.layer_overhead_s

    def iteration_time(self, shapes: list[IterationShape], pipelined: bool = True) -> float:
        """`pipelined=False`: the batch is one micro-batch, so the stages take turns (FasterTransformer
        with its microbatch size equal to the batch size, the Orca paper's best baseline configurations)."""
        parts = max(1, min(self.pp, len(shapes))) if pipelined else 1
        micro_batches = partition(shapes, parts)
        return self.pp * max(self.stage_time(group) for group in micro_batches)


COST_MODELS = ("this-machine", "gpt3-175b-a100-tp8pp2")


def make_cost_model(name: str, *, tp: int | None = None, pp: int | None = None) -> LinearCostModel | ClusterCostModel:
    if name == "this-machine":
        if (tp or 1) != 1 or (pp or 1) != 1:
            raise ValueError("the this-machine cost model was fitted on one CPU process: tp and pp must be 1")
        from loadtest.fitted import THIS_MACHINE

        return LinearCostModel(name=name, **THIS_MACHINE)
    if name == "gpt3-175b-a100-tp8pp2":
        return ClusterCostModel(tp=tp or 8, pp=pp or 2)
    raise ValueError(f"cost model {name!r} is not one of {COST_MODELS}")
