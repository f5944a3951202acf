"""Every rank's GPU memory before launch, per phase of a step, from the bound config (``empg plan``;
checked against the device by ``empg check --gpu-memory-gib`` and by ``empg train`` before its
engines start).

A training rank (the plan covers every pipeline stage and reports the most loaded) holds, always:

    weights, gradients (DDP's fp32 buffer), fp32 main parameters and Adam's m, v (both / DP with the
    distributed optimizer), the EMA anchor (compute weights, fp32 master / DP; none when the KL's
    anchor is the behaviour policy), a distillation teacher's weights (its dtype; none when
    offloaded between passes), the unfused attention's score buffer (Megatron's
    GlobalMemoryBuffer, kept once grown), the step's micro-batch tensors, a sleeping engine
    (colocated), its CUDA context

and on top of that, one phase at a time:

    rollout      the engine awake (vLLM: ``gpu_memory_utilization`` x the device; hf: its weights
                 and KV cache) in place of the asleep one
    weight sync  the engine's weights woken, one bucket on the GPU
    old / anchor the forward-only passes: one forward micro-batch's logits, one layer's working set
    teacher      the same for the teacher's shape (its weights too when offloaded); a teacher on
                 the engines (``placement: engine``) instead beside the engine: awake in the rollout
                 (vLLM: ``teacher.gpu_memory_utilization`` x the device), asleep otherwise
    update       the activations of the micro-batches in flight (``memory_terms.layer_activations``
                 x layers x tokens, the pipeline's in-flight count, recompute), the logits and
                 their gradient (last stage), the largest weight's bf16 gradient
    optimizer    Adam's temporaries (torch's foreach: one fp32 buffer per shard)
    checkpoint   a DP-sharded anchor master gathered whole

An engine rank (``rollout.placement: disaggregated``) holds its vLLM budget. The device holds the
allocator's peak plus ``Calibration.allocator_slack`` of it, the CUDA context and the engine's
share. Host memory per node: /dev/shm buckets, pinned or offloaded copies, reward workers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from megatron_empg.config import RunConfig
from megatron_empg.mcore.checkpoint.size import DTYPE_BYTES
from megatron_empg.trainer.bind import memory_terms as terms
from megatron_empg.trainer.bind.memory_terms import BF16, CUDA, FP32, GIB, Calibration, bucket_file_bytes, rank_shape

# torch reports 85,017,493,504 bytes for an H100 80GB HBM3 (benchmarks/results/train_step_gpu_d63de0f.json)
DEFAULT_DEVICE_BYTES = 85_017_493_504
PHASES = ("rollout", "weight_sync", "old_pass", "anchor_pass", "teacher_pass", "update", "optimizer", "checkpoint")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What the machine runs besides the config: ``fused_swiglu`` (CUDA's fusion plan),
    ``vocab_kernels`` ("triton" on CUDA, "torch": the chunked fp32 path), the constants."""

    fused_swiglu: bool = True
    vocab_kernels: str = "triton"
    calibration: Calibration = CUDA


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One kind of rank: ``resident`` terms (name -> bytes, always held), ``phases`` (phase ->
    its transient terms), ``device`` (bytes not managed by the trainer's allocator: the CUDA
    context, the engine's share, by phase)."""

    kind: str
    resident: dict[str, int]
    phases: dict[str, dict[str, int]]
    device: dict[str, dict[str, int]]
    slack: float

    def allocated(self, phase: str) -> int:
        """The trainer allocator's bytes in ``phase`` (what ``torch.cuda.max_memory_allocated`` reads)."""
        return sum(self.resident.values()) + sum(self.phases[phase].values())

    def total(self, phase: str) -> int:
        """The device bytes in ``phase``: allocated, its slack, and the rest."""
        return int(self.allocated(phase) * (1 + self.slack)) + sum(self.device[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    def group(self, *names: str) -> int:
        return sum(v for k, v in self.resident.items() if k in names)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan of a bound run on ``device_bytes`` per GPU."""

    summary: str
    device_bytes: int
    device_assumed: bool
    ranks: list[RankPlan]  # the most loaded training stage, then the engine rank (disaggregated)
    host: dict[str, int]
    stages: list[RankPlan]  # every pipeline stage's training rank

    @property
    def peak(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def fits(self) -> bool:
        return all(r.peak_bytes <= self.device_bytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        ranks = []
        for r in self.ranks:
            ranks.append(
                {
                    "kind": r.kind,
                    "peak_bytes": r.peak_bytes,
                    "peak_phase": r.peak_phase,
                    "weights_and_optimizer_bytes": r.group("weights", "gradients", "main_parameters", "adam"),
                    "anchor_bytes": r.group("anchor_weights", "anchor_master"),
                    "activation_bytes": r.phases.get("update", {}).get("activations", 0),
                    "resident": r.resident,
                    "phases": r.phases,
                    "device": r.device,
                    "phase_totals": {p: r.total(p) for p in r.phases},
                }
            )
        return {
            "summary": self.summary,
            "device_bytes": self.device_bytes,
            "device_assumed": self.device_assumed,
            "fits": self.fits,
            "ranks": ranks,
            "host": self.host,
        }

    def describe(self) -> str:
        lines = [self.summary]
        for r in self.ranks:
            free = self.device_bytes - r.peak_bytes
            verdict = f"fits ({_gib(free)} free)" if free >= 0 else f"DOES NOT FIT ({_gib(-free)} over)"
            lines.append(
                f"{r.kind}: peak {_gib(r.peak_bytes)} of {_gib(self.device_bytes)} in the {r.peak_phase} "
                f"phase: {verdict}"
            )
            held = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in r.resident.items() if v)
            lines.append(f"  held always: {held}")
            for phase in r.phases:
                extra = {**r.phases[phase], **r.device[phase]}
                parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in extra.items() if v) or "-"
                lines.append(f"  {phase:<12} {_gib(r.total(phase)):>10}  = held + {parts}")
        lines.append("host per node: " + ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in self.host.items()))
        return "\n".join(lines)

    def dump(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


# --------------------------------------------------------------------------------------------


def plan_memory(
    components, *, device_bytes: int | None = None, options: PlanOptions = PlanOptions(), ranks_per_node: int = 8
) -> MemoryPlan:
    """The ``MemoryPlan`` of ``components`` (``trainer.bind.build.bind``'s) on GPUs of ``device_bytes``
    (None: an H100 80GB's, marked as assumed)."""
    config, model, layout = components.config, components.model, components.layout
    device = device_bytes or DEFAULT_DEVICE_BYTES
    stages = [_training_stage(components, p, device, options) for p in range(layout.pp)]
    ranks = [max(stages, key=lambda r: r.peak_bytes)]
    if layout.engine_ranks:
        ranks.append(_engine_rank(config, device, options.calibration))
    summary = (
        f"plan: {model.name} on {layout.world_size} ranks (TP {layout.tp} x PP {layout.pp}"
        f"{f' x CP {layout.cp}' if layout.cp > 1 else ''} x DP {layout.dp}"
        f"{f'; experts EP {config.parallel.expert_model_parallel_size} x ETP {config.parallel.expert_tp_size}' if model.is_moe else ''}"
        f"{f', {layout.engine_ranks} engine ranks' if layout.engine_ranks else ''}), attention "
        f"{model.attention_backend}, {config.train.params_dtype}; device {_gib(device)}"
        f"{' (assumed: an H100 80GB; --gpu-memory-gib to set it)' if device_bytes is None else ''}"
    )
    return MemoryPlan(summary, device, device_bytes is None, ranks, _host(components, ranks_per_node), stages)


def _update_tokens(config: RunConfig) -> tuple[int, int]:
    """(tokens of the update's largest micro-batch on one rank, rows in it): a context-parallel
    rank holds 1 / CP of every row."""
    train = config.train
    if train.max_tokens_per_microbatch is not None:
        return train.max_tokens_per_microbatch, 1
    rows = 1 if train.packing else train.micro_batch_size
    return -(-train.micro_batch_size * train.max_seq_len // config.parallel.context_parallel_size), rows


def _in_flight_layers(layers: int, pp: int, vpp: int | None, pp_rank: int) -> int:
    """Layers of activations held at once on stage ``pp_rank``: a micro-batch per stage ahead in
    1F1B (at most PP), Megatron's warm-up count + 1 model chunks with the interleaved schedule."""
    if pp == 1:
        return layers
    if not vpp:
        return (pp - pp_rank) * layers
    chunks = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1
    return chunks * (layers // vpp)


def _optimizer_shards(config: RunConfig, layout) -> tuple[int, int]:
    """(ranks the dense weights' fp32 state is sharded over, ranks the experts' is): DP x CP and
    the expert data-parallel size with the distributed optimizer; (1, 1) without."""
    if not config.optimizer.use_distributed_optimizer:
        return 1, 1
    return layout.dp * layout.cp, layout.training_ranks // config.parallel.expert_grid_size


def _anchor_weights(components, shape, sharded: bool) -> int:
    """The anchor's compute weights on this rank (``mcore.anchor.storage``). Row-wise FP8: the
    decoder's linears and the local (grouped or sequential) experts 1 byte, the rest (embedding,
    output layer, norms, routers; TE's experts) dequantized in the forward dtype, plus 1 byte each for the
    gathered FP8 buffer with the distributed optimizer (scales: 4 bytes a row, neglected). TE FP8:
    FP8 and a forward-dtype copy of every parameter (an upper bound; TE keeps norms unquantized)."""
    config = components.config
    anchor, forward = config.algorithm.anchor, DTYPE_BYTES[config.train.params_dtype]
    if shape.adapters:  # the base with averaged adapters: the adapters' own dtype
        return shape.trainable * DTYPE_BYTES[_trained_dtype(components.model, config.train)]
    if anchor.compute_dtype != "float8_e4m3fn":
        return shape.trainable * DTYPE_BYTES[anchor.compute_dtype]
    if components.anchor_storage[0] == "te":
        return shape.trainable * (1 + forward)
    experts = components.experts
    fp8 = shape.decoder_linears + (shape.expert_params if experts and experts.name in ("grouped", "sequential") else 0)
    if anchor.fp8_output_layer and shape.last_stage and not components.model.tie_word_embeddings:
        fp8 += shape.vocab_rows * components.model.hidden_size
    return fp8 + (shape.trainable - fp8) * (forward + (1 if sharded else 0))


def _sharded_elements(shape, dp_shard: int, expert_dp: int) -> int:
    """This rank's elements of the fp32 optimizer state (and the anchor's master): a LoRA policy's
    adapters (never sharded), else its parameters over the optimizer's ranks."""
    if shape.adapters:
        return shape.adapters
    return (shape.params - shape.expert_params) // dp_shard + shape.expert_params // expert_dp


def _trained_dtype(model, train) -> str:
    """The dtype of what the optimizer steps: a LoRA policy's adapters (``model.lora.dtype``, else
    the parameters'), or the parameters."""
    return (model.lora.dtype if model.lora is not None else None) or train.params_dtype


def _training_stage(components, pp_rank: int, device: int, options: PlanOptions) -> RankPlan:
    config, model, layout, stats = components.config, components.model, components.layout, components.stats
    train, parallel, cal = config.train, config.parallel, options.calibration
    shape = rank_shape(model, parallel, pp_rank)
    dp_shard, expert_dp = _optimizer_shards(config, layout)
    sharded = _sharded_elements(shape, dp_shard, expert_dp)
    params_bytes = DTYPE_BYTES[train.params_dtype]
    attention = model.attention_backend
    tokens, rows = _update_tokens(config)
    forward_tokens = train.max_tokens_per_forward_microbatch or tokens
    heads = model.num_attention_heads // layout.tp
    anchor = config.algorithm.anchor
    resident = {
        "weights": shape.params * params_bytes + shape.adapters * DTYPE_BYTES[_trained_dtype(model, train)],
        "gradients": shape.trainable * FP32,
        "main_parameters": sharded * FP32 if DTYPE_BYTES[_trained_dtype(model, train)] != FP32 else 0,
        "adam": 2 * sharded * FP32,
        "anchor_weights": 0,
        "anchor_master": 0,
        "score_buffer": BF16 * heads * min(train.max_seq_len, max(tokens, forward_tokens)) ** 2
        if attention == "unfused"
        else 0,
        "micro_batches": terms.microbatch_tensor_bytes(  # this rank's share of the step's rows, on the device
            config,
            layout.samples_per_replica * train.max_seq_len // layout.cp,
            (stats.old_topk or stats.anchor_topk) + (components.distill.term.teacher_k if components.distill else 0),
        ),
    }
    if stats.anchor:
        resident["anchor_weights"] = _anchor_weights(components, shape, dp_shard > 1 or expert_dp > 1)
        resident["anchor_master"] = 0 if anchor.master_on_cpu else sharded * FP32
    linear, quadratic = terms.layer_activations(
        model,
        layout.tp,
        attention,
        fused_swiglu=options.fused_swiglu,
        cp=layout.cp,
        cal=cal,
        etp=parallel.expert_tp_size,
    )
    in_flight = _in_flight_layers(shape.layers, layout.pp, parallel.virtual_pipeline_model_parallel_size, pp_rank)
    squares = terms.sequence_terms(tokens, train.max_seq_len)
    per_layer = linear * tokens + quadratic * squares
    if train.recompute == "full":
        unit = train.recompute_num_layers
        activations = in_flight // unit * BF16 * model.hidden_size * tokens + unit * per_layer
    elif train.recompute == "selective":
        activations = in_flight * linear * tokens + (10 * heads * squares if quadratic else 0)  # one layer's scores
    else:
        activations = in_flight * per_layer + (4 * heads * squares if quadratic else 0)  # + the softmax's fp32 gradient
    vocab = shape.vocab_rows if shape.last_stage else 0
    scratch = FP32 * cal.vocab_chunk * vocab if options.vocab_kernels == "torch" else 0
    if train.fused_output_loss:
        update_logits = BF16 * cal.fused_output_chunk * vocab
    else:
        update_logits = terms.logits_bytes(
            tokens, vocab, inplace_backward=config.algorithm.loss.inplace_backward, padded_rows=rows
        )
    h, f = model.hidden_size, model.ffn_hidden_size // layout.tp
    if model.is_moe:
        mlp = terms.moe_forward_bytes(model, parallel.expert_tp_size, fused_swiglu=options.fused_swiglu)
    else:
        mlp = (6 if options.fused_swiglu else 8) * f
    forward_layer = forward_tokens * (BF16 * (4 * h + 3 * heads * model.kv_channels) + mlp)
    if attention == "unfused":
        forward_layer += 8 * heads * terms.sequence_terms(forward_tokens, train.max_seq_len)
    forward = {"logits": BF16 * forward_tokens * vocab, "vocab_scratch": scratch, "one_layer": int(forward_layer)}
    engine = _colocated_engine(config, model, layout, device, cal)
    if components.distill is not None and components.distill.placement.on_engines:
        for state, share in _teacher_engine(components, device, cal).items():
            engine[state].update(share)
    phases = {
        "rollout": {},
        "weight_sync": {"bucket": int(config.weight_sync.bucket_size_mb * 2**20)},
        "old_pass": dict(forward),
        "anchor_pass": dict(forward) if stats.anchor else {},
        "teacher_pass": {},
        "update": {
            "activations": int(activations),
            "logits": update_logits,
            "vocab_scratch": 2 * scratch,
            "weight_gradient": 0 if shape.adapters else BF16 * shape.largest_weight,  # a frozen base: none
            "moe_dispatch": terms.moe_dispatch_bytes(model, tokens),
        },
        "optimizer": {"adam_temporaries": sharded * FP32},
        # the save gathers a sharded anchor master whole (EmaAnchor.full_master_state); the rest
        # goes to the host one tensor at a time (mcore.checkpoint.stream)
        "checkpoint": {
            "anchor_master_gathered": shape.trainable * FP32
            if stats.anchor and (dp_shard > 1 or expert_dp > 1) and not anchor.master_on_cpu
            else 0
        },
    }
    if components.distill is not None and not components.distill.placement.on_engines:
        resident["teacher_weights"], phases["teacher_pass"] = _teacher_terms(
            components, pp_rank, forward_tokens, vocab, scratch, options
        )
    asleep = {"cuda_context": cal.cuda_context, **engine["asleep"]}
    device_terms = {phase: dict(asleep) for phase in PHASES}
    device_terms["rollout"] = {"cuda_context": cal.cuda_context, **engine["awake"]}
    device_terms["weight_sync"] = {"cuda_context": cal.cuda_context, **engine["weights"]}
    kind = "training rank" + (f" (pipeline stage {pp_rank} of {layout.pp})" if layout.pp > 1 else "")
    return RankPlan(kind, resident, phases, device_terms, cal.allocator_slack)


def _teacher_terms(components, pp_rank: int, tokens: int, vocab: int, scratch: int, options: PlanOptions):
    """(resident bytes, teacher-pass terms) of the distillation teacher on this pipeline stage:
    its weights in ``teacher.dtype`` (held, or brought in for the pass when offloaded), one forward
    micro-batch's logits and one of its layers' working set (as the old pass's, at its shape)."""
    config, layout, teacher = components.config, components.layout, components.distill.model
    spec = config.algorithm.distill.teacher
    weights = rank_shape(teacher, config.parallel, pp_rank).params * DTYPE_BYTES[spec.dtype]
    heads, h = teacher.num_attention_heads // layout.tp, teacher.hidden_size
    mlp = (6 if options.fused_swiglu else 8) * (teacher.ffn_hidden_size // layout.tp)
    layer = tokens * (BF16 * (4 * h + 3 * heads * teacher.kv_channels) + mlp)
    if teacher.attention_backend == "unfused":
        layer += 8 * heads * terms.sequence_terms(tokens, config.train.max_seq_len)
    phase = {"logits": BF16 * tokens * vocab, "vocab_scratch": scratch, "one_layer": int(layer)}
    if spec.offload:
        phase["teacher_weights"] = weights
    return (0 if spec.offload else weights), phase


def _teacher_engine(components, device: int, cal: Calibration) -> dict[str, dict[str, int]]:
    """A distillation teacher engine's share (``placement: engine``) beside the colocated engine:
    awake while the rollout scores (vLLM: ``teacher.gpu_memory_utilization`` x the device and its
    process's context; hf: its weights and one batched forward's logits of every sample), asleep
    (level 1) otherwise with ``rollout.sleep_while_training``, else as awake."""
    config, layout, teacher = components.config, components.layout, components.distill.model
    rollout, spec = config.rollout, config.algorithm.distill.teacher
    if rollout.engine == "hf":
        weights = terms.params_bytes(teacher, spec.dtype)
        tokens = layout.samples_per_replica * (layout.dp // layout.engines) * config.train.max_seq_len
        awake = {"teacher_engine_weights": weights, "teacher_engine_logits": FP32 * tokens * teacher.vocab_size}
        asleep = {} if rollout.sleep_while_training else {"teacher_engine_weights": weights}
    else:
        awake = {
            "teacher_engine_awake": int(spec.gpu_memory_utilization * device),
            "teacher_engine_context": cal.cuda_context,
        }
        asleep = {"teacher_engine_asleep": cal.engine_asleep} if rollout.sleep_while_training else dict(awake)
    return {"asleep": asleep, "awake": awake, "weights": asleep}


def _colocated_engine(config: RunConfig, model, layout, device: int, cal: Calibration) -> dict[str, dict[str, int]]:
    """The engine's share of a training rank's GPU: asleep, awake, woken weights only."""
    rollout = config.rollout
    if layout.engine_ranks:  # disaggregated: the engines have GPUs of their own
        return {"asleep": {}, "awake": {}, "weights": {}}
    weights = terms.params_bytes(model, rollout.dtype, rollout.tensor_parallel_size)
    context = cal.cuda_context if not rollout.in_process else 0
    if rollout.engine == "hf":
        tokens = (
            layout.samples_per_replica
            * (layout.dp // layout.engines)
            * (rollout.max_model_len or model.max_position_embeddings)
        )
        kv = terms.kv_cache_bytes_per_token(model, rollout.dtype) * tokens
        asleep = {} if rollout.sleep_while_training else {"engine_weights": weights}
        return {
            "asleep": asleep,
            "awake": {"engine_weights": weights, "engine_kv_cache": kv},
            "weights": {"engine_weights": weights},
        }
    awake = int(rollout.gpu_memory_utilization * device)
    if not rollout.sleep_while_training:
        asleep = {"engine_awake": awake, "engine_context": context}
    else:
        asleep = {"engine_asleep": cal.engine_asleep}
    return {
        "asleep": asleep,
        "awake": {"engine_awake": awake, "engine_context": context},
        "weights": {"engine_asleep": cal.engine_asleep, "engine_weights": weights},
    }


def _engine_rank(config: RunConfig, device: int, cal: Calibration) -> RankPlan:
    awake = int(config.rollout.gpu_memory_utilization * device)
    phases = {"rollout": {}}
    return RankPlan(
        "engine rank", {}, phases, {"rollout": {"cuda_context": cal.cuda_context, "engine_awake": awake}}, 0.0
    )


def _host(components, ranks_per_node: int) -> dict[str, int]:
    """Host memory per node of ``ranks_per_node`` GPUs (one rank each)."""

    config, model, layout = components.config, components.model, components.layout
    per_node = min(ranks_per_node, layout.world_size)
    engines = max(1, layout.engines * per_node // max(layout.training_ranks, 1)) if not layout.engine_ranks else 0
    rollout, anchor = config.rollout, config.algorithm.anchor
    shape = rank_shape(model, config.parallel, 0)
    sharded = _sharded_elements(shape, *_optimizer_shards(config, layout))
    # rollout.max_staleness >= 1: each engine owner stages up to 3 whole updates (weight_sync.staging)
    owners = max(1, min(ranks_per_node, layout.engine_ranks) // rollout.tensor_parallel_size)
    host = {
        "shm_buckets": engines * bucket_file_bytes(config, model) if config.weight_sync.transport == "shm_file" else 0,
        "anchor_master_pinned": per_node * sharded * FP32 if components.stats.anchor and anchor.master_on_cpu else 0,
        "engine_weights_offloaded": engines * terms.params_bytes(model, rollout.dtype, rollout.tensor_parallel_size)
        if rollout.sleep_while_training and rollout.sleep_level == 1
        else 0,
        "checkpoint_staging": per_node * shape.largest_weight * FP32,  # one tensor per rank at a time
        "staged_weight_updates": owners * 3 * terms.params_bytes(model, rollout.dtype)
        if layout.engine_ranks and rollout.max_staleness
        else 0,  # on an engine node
    }
    return host
