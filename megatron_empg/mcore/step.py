"""The passes of one RL step through Megatron's ``get_forward_backward_func`` (any TP / PP / VPP).

    stats pass   forward only (the old pass on the policy, the anchor pass on the anchor): per
                 token log pi at the targets (and at extra ids), logsumexp, entropy, top-k ids
                 and log-probs, from ``parallel.vocab_parallel_token_stats``
    update pass  forward + backward: ``parallel.rl_loss`` as a Megatron loss function returning
                 (sum, count, metrics); the optimizer step and the LR schedule

A micro-batch is a ``core.microbatch.MicroBatch`` (padded rows, or one packed row of several
sequences: Megatron's THD ``PackedSeqParams``), on the model's device: the caller puts it there
(``trainer.batching.batch``), these passes move nothing. Under pipeline parallelism every micro-batch of
one call has the same [b, s] shape (the stages exchange fixed-size activations). The logits never
leave the loss function: only [b, s] and [b, s, k] tensors come out, and only on the
last pipeline stage (``None`` on the others; ``share_stats`` sends them to every stage with tensor
broadcasts).

The update pass takes its objective as a bound function (``trainer.bind.build.bind_loss``: ``rl_loss``
with the run's options), so that this module knows no loss configuration. With ``fused_output``
(``train.fused_output_loss``) the model stops before its output layer (GPTModel's
``output_processor`` hook) and the objective gets an ``OutputLayerInput`` (the layer's input and
weight) instead of the logits: ``parallel.fused_output`` computes them one chunk of tokens at a
time, so that the [b * s, V_local] logits and their gradient never exist whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.aggregation import LossSum
from megatron_empg.core.microbatch import MicroBatch, StatsResult
from megatron_empg.core.step_guard import GradNormGuard, SkipReason
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.moe import replay as router_replay
from megatron_empg.mcore.moe.routing import LossUnits, router_recorder, set_aux_loss_scale
from megatron_empg.mcore.parallel_state import ParallelGroups
from megatron_empg.mcore.thd import thd_layout
from megatron_empg.parallel.collectives import collective_device
from megatron_empg.parallel.context_parallel import CpChunks, split_microbatch
from megatron_empg.parallel.fused_output import OutputLayerInput
from megatron_empg.parallel.rl_loss import RLLoss
from megatron_empg.parallel.vocab_parallel import vocab_parallel_token_stats

cpu_shims.install_pre_import()

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


def causal_mask(seq_length: int, device: torch.device | None = None) -> Tensor:
    """[1, 1, s, s] bool, True above the diagonal (masked), as Megatron's local attention expects.

    Right-padded sequences need nothing more: padding comes after every real token, and its
    positions carry no loss.
    """
    return torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device).triu_(1)


def _model_forward(model, batch: MicroBatch, *, fused_output: bool = False) -> Tensor | OutputLayerInput:
    """[b, s] input_ids -> the model's output on the last stage: logits [b, s, V_local], or with
    ``fused_output`` the ``OutputLayerInput`` (``_output_layer_input``). A packed row goes in as
    THD: attention and RoPE positions restart at every ``cu_seqlens`` boundary."""
    input_ids = batch.input_ids
    b, s = input_ids.shape
    hook = {"output_processor": _output_layer_input} if fused_output else {}
    if not batch.packed:
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        return model(input_ids, positions, causal_mask(s, input_ids.device), **hook)
    return model(input_ids, batch.position_ids, None, packed_seq_params=thd_layout(batch), **hook)


def _output_layer_input(*, hidden_states: Tensor, output_layer, output_weight: Tensor | None, config, **_):
    """GPTModel's ``output_processor``: the output layer's input [b, s, H] and weight [V_local, H]
    (the shared embedding's when tied) in place of its logits.

    The input goes through what ColumnParallelLinear does to it around its matmul, so that the
    gradient reaching the decoder is Megatron's: under sequence parallelism the all-gather of the
    [s / TP, b, H] shards (backward: reduce-scatter), else an identity whose backward all-reduces
    the TP ranks' parts (a no-op at TP 1).
    """
    if output_layer.bias is not None or config.use_mup:
        raise ValueError("fused_output: an output layer with a bias or MuP logit scaling is not supported")
    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True, group=group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    weight = output_layer.weight if output_weight is None else output_weight
    return OutputLayerInput(hidden.transpose(0, 1), weight)  # [s, b, H] -> [b, s, H], as the logits


def _vocab_shard(width: int, groups: ParallelGroups) -> dict:
    """This TP rank's vocab shard of ``width`` (padded) columns."""
    return {"vocab_start": groups.tp_rank * width, "tp_group": groups.tp_group}


def _data_iterators(microbatches: Sequence[MicroBatch], num_chunks: int):
    """One iterator per model chunk (interleaved schedules walk every chunk over all micro-batches)."""
    if num_chunks == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in range(num_chunks)]


def _run_schedule(models, microbatches: Sequence[MicroBatch], forward_step, *, forward_only: bool) -> list:
    """Megatron's schedule over ``microbatches``; each forward first gives the chunk's routers the
    micro-batch's replayed experts (``routed_experts``: ``mcore.moe.replay``), dropped after."""
    b, s = microbatches[0].shape
    s *= microbatches[0].cp_size  # Megatron sizes the pipeline's messages as seq_length / CP

    def replaying_step(data_iterator, model):
        return forward_step(_Replaying(data_iterator, model), model)

    try:
        return get_forward_backward_func()(
            forward_step_func=replaying_step,
            data_iterator=_data_iterators(microbatches, len(models)),
            model=list(models),
            num_microbatches=len(microbatches),
            seq_length=s,
            micro_batch_size=b,
            forward_only=forward_only,
        )
    finally:
        router_replay.clear(models)


class _Replaying:
    """A micro-batch iterator whose ``next`` also sets ``model``'s routers for that micro-batch."""

    def __init__(self, iterator, model) -> None:
        self._iterator, self._model = iterator, model

    def __next__(self) -> MicroBatch:
        batch = next(self._iterator)
        router_replay.set_micro_batch(self._model, batch)
        return batch


# ---------------------------------------------------------------- stats pass (forward only)


@dataclass(frozen=True)
class StatsRequest:
    """What a forward-only pass computes per token.

    Attributes:
        vocab_size: the real vocabulary (Megatron's padded columns are masked).
        k: top-k size (0: none).
        extra_ids_key: ``MicroBatch`` field of [b, s, M] global ids whose log-probs are wanted besides
            the target's (the anchor pass of a reverse Top-k KL: the policy's top-k), or None.
        with_entropy: compute the entropy.
    """

    vocab_size: int
    k: int = 0
    extra_ids_key: str | None = None
    with_entropy: bool = True
    chunk_size: int | None = None


def _stats_loss(batch: MicroBatch, request: StatsRequest, groups: ParallelGroups, logits: Tensor):
    b, s, width = logits.shape
    ids = batch.target_ids.reshape(b * s, 1)
    if request.extra_ids_key is not None:
        extra = getattr(batch, request.extra_ids_key)
        ids = torch.cat([ids, extra.reshape(b * s, -1)], dim=-1)
    kwargs = {"chunk_size": request.chunk_size} if request.chunk_size else {}
    stats = vocab_parallel_token_stats(
        logits.reshape(b * s, width),
        ids,
        request.k,
        vocab_size=request.vocab_size,
        with_entropy=request.with_entropy,
        **_vocab_shard(width, groups),
        **kwargs,
    )
    topk = request.k > 0
    out = StatsResult(
        logprobs=stats.logprobs[:, 0].reshape(b, s),
        lse=stats.lse.reshape(b, s),
        topk_ids=stats.topk_ids.reshape(b, s, -1) if topk else None,
        topk_logprobs=stats.topk_logprobs.reshape(b, s, -1) if topk else None,
        extra_logprobs=stats.logprobs[:, 1:].reshape(b, s, -1) if request.extra_ids_key is not None else None,
        entropy=stats.entropy.reshape(b, s) if stats.entropy is not None else None,
    )
    zero = logits.new_zeros(())
    return zero, torch.zeros((), dtype=torch.int), out


def forward_stats(
    models, microbatches: Sequence[MicroBatch], request: StatsRequest, groups: ParallelGroups
) -> list[StatsResult] | None:
    """Forward-only pass: per micro-batch a ``core.microbatch.StatsResult`` ([b, s] / [b, s, k]
    float32 / int64 tensors: ``logprobs``, ``lse``, and what ``request`` asks: ``topk_ids`` and
    ``topk_logprobs``, ``extra_logprobs``, ``entropy``) on the last pipeline stage, None on the
    others. TokenStats semantics (``vocab_parallel_token_stats``).
    """

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return _model_forward(model, batch), partial(_stats_loss, batch, request, groups)

    for model in models:
        model.eval()
    outputs = []
    with torch.no_grad():
        for run in _same_shape_runs(microbatches, groups.pp_size):
            outputs += _run_schedule(models, run, forward_step, forward_only=True)
    return outputs if groups.is_last_stage else None


def _same_shape_runs(microbatches: Sequence[MicroBatch], pp_size: int) -> list[Sequence[MicroBatch]]:
    """The schedule calls of a forward-only pass: under pipeline parallelism, each run of
    consecutive micro-batches of one [b, s] (a pipeline call exchanges fixed-size activations; the
    mini-batches of a step may differ in width, each a multiple of the interleaved schedule's
    group); else all of them in one call."""
    if pp_size == 1:
        return [microbatches]
    runs: list[list[MicroBatch]] = []
    for batch in microbatches:
        if not runs or runs[-1][0].shape != batch.shape:
            runs.append([])
        runs[-1].append(batch)
    return runs


def share_stats(
    outputs: list[StatsResult] | None,
    microbatches: Sequence[MicroBatch],
    request: StatsRequest,
    groups: ParallelGroups,
) -> list[StatsResult]:
    """``forward_stats``' outputs (on the last pipeline stage) on every stage, by one tensor
    broadcast per output over the pipeline group: shapes follow from the micro-batches and the
    request, so the other stages allocate the same tensors on their device. (No pickling: an object
    broadcast of CUDA tensors would unpickle them onto the sender's GPU.)"""
    if groups.pp_size == 1:
        return outputs
    source = dist.get_global_rank(groups.pp_group, groups.pp_size - 1)
    shared = []
    for i, batch in enumerate(microbatches):
        tensors = {}
        for name, shape, dtype in _stats_layout(batch, request):
            if groups.is_last_stage:
                tensor = getattr(outputs[i], name).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=batch.input_ids.device)
            dist.broadcast(tensor, src=source, group=groups.pp_group)
            tensors[name] = tensor
        shared.append(StatsResult(**tensors))
    return shared


def _stats_layout(batch: MicroBatch, request: StatsRequest) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(``StatsResult`` field, shape, dtype) of each statistic ``_stats_loss`` gives for ``batch``."""
    b, s = batch.shape
    layout = [("logprobs", (b, s), torch.float32), ("lse", (b, s), torch.float32)]
    if request.k:
        layout += [("topk_logprobs", (b, s, request.k), torch.float32), ("topk_ids", (b, s, request.k), torch.int64)]
    if request.extra_ids_key is not None:
        layout.append(("extra_logprobs", (b, s, getattr(batch, request.extra_ids_key).shape[-1]), torch.float32))
    if request.with_entropy:
        layout.append(("entropy", (b, s), torch.float32))
    return layout


def score_sequences(models, sequences: Sequence[Sequence[int]], vocab_size: int, groups: ParallelGroups) -> Tensor:
    """[N, L-1] float32 log p(x_t | x_<t) of N equal-length token sequences under the policy, on
    every pipeline stage (one micro-batch per sequence). The trainer's side of the consistency gate."""
    lengths = {len(seq) for seq in sequences}
    if len(lengths) != 1 or min(lengths) < 2:
        raise ValueError(f"sequences must all have the same length >= 2, got lengths {sorted(lengths)}")
    device = next(models[0].parameters()).device
    ids = torch.tensor(list(sequences), dtype=torch.long, device=device)
    if groups.cp_size > 1:  # packed rows split over the context-parallel ranks, then gathered back
        return _score_context_parallel(models, ids, vocab_size, groups)[:, :-1]
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # the last position is dropped
    microbatches = [MicroBatch(ids[i : i + 1], targets[i : i + 1]) for i in range(len(ids))]
    outputs = forward_stats(models, microbatches, StatsRequest(vocab_size=vocab_size, with_entropy=False), groups)
    logprobs = torch.empty(ids.shape, dtype=torch.float32, device=device)
    if outputs is not None:
        logprobs.copy_(torch.cat([out.logprobs for out in outputs]))
    return broadcast_from_last_stage(logprobs, groups)[:, :-1]


def _score_context_parallel(models, ids: Tensor, vocab_size: int, groups: ParallelGroups) -> Tensor:
    """``score_sequences``' [N, L] log-probs (the last position meaningless) under context
    parallelism: each sequence a packed row padded to a multiple of 2 x CP, this rank's share
    scored, the shares all-gathered over the CP group and put back in order."""
    n, length = ids.shape
    width = -(-length // (2 * groups.cp_size)) * 2 * groups.cp_size
    rows = torch.zeros(n, width, dtype=torch.long, device=ids.device)
    rows[:, :length] = ids
    targets = torch.cat([rows[:, 1:], torch.zeros_like(rows[:, :1])], dim=1)
    cu = torch.tensor([0, width], dtype=torch.int32, device=ids.device)
    positions = torch.arange(width, device=ids.device)[None]
    chunks = CpChunks.from_cu_seqlens([0, width], groups.cp_size, groups.cp_rank)
    microbatches = [
        split_microbatch(
            MicroBatch(
                rows[i : i + 1],
                targets[i : i + 1],
                position_ids=positions,
                seq_ids=torch.zeros_like(positions),
                cu_seqlens=cu,
                max_seqlen=width,
            ),
            groups.cp_size,
            groups.cp_rank,
        )
        for i in range(n)
    ]
    outputs = forward_stats(models, microbatches, StatsRequest(vocab_size=vocab_size, with_entropy=False), groups)
    local = torch.empty(n, width // groups.cp_size, dtype=torch.float32, device=ids.device)
    if outputs is not None:
        local.copy_(torch.cat([out.logprobs for out in outputs]))
    local = broadcast_from_last_stage(local, groups)
    shares = [torch.empty_like(local) for _ in range(groups.cp_size)]
    dist.all_gather(shares, local, group=groups.cp_group)
    full = torch.cat(shares, dim=1)[:, chunks.full_order(ids.device)]  # rank-major -> the row's order
    return full[:, :length]


# ---------------------------------------------------------------- update pass


LossFunction = Callable[..., RLLoss]
"""``loss_fn(logits [b, s, V_local] | OutputLayerInput, batch: MicroBatch, *, vocab_start, tp_group
[, cp_group]) -> RLLoss``; ``cp_group`` under context parallelism."""


def _update_loss(batch: MicroBatch, loss_fn: LossFunction, groups: ParallelGroups, output):
    width = output.weight.shape[0] if isinstance(output, OutputLayerInput) else output.shape[-1]
    cp = {"cp_group": groups.cp_group} if groups.cp_size > 1 else {}  # the batch is one CP rank's share
    out = loss_fn(output, batch, **_vocab_shard(width, groups), **cp)
    # Megatron accumulates the count in an int32 tensor and, with calculate_per_token_loss, divides
    # the gradients once by its global sum (finalize_model_grads).
    return out.loss.loss_sum, out.loss.count.to(torch.int), out.metrics


@dataclass
class StepResult:
    """What one optimizer step reports, identical on every rank.

    Attributes:
        metrics: name -> global mean (``loss`` and ``policy_loss`` over the aggregation's units,
            the others token means), reduced over micro-batches and DP.
        grad_norm: the global gradient norm before clipping.
        lr: the learning rate used by this step (of the last applied step, if it was refused).
        skipped: why the step was refused (``core.step_guard``: the parameters, the optimizer's
            state and the LR schedule are as before it), or None if it was applied.
    """

    metrics: dict[str, float]
    grad_norm: float
    lr: float
    skipped: str | None = None


def reduce_metrics(per_microbatch: list[dict[str, LossSum]] | None, groups: ParallelGroups) -> dict[str, float]:
    """Sum (sum, count) pairs over micro-batches and DP (x CP) ranks, divide once, and share the
    result from the last pipeline stage with every rank. One all-reduce and one broadcast."""
    names = sorted(per_microbatch[0]) if per_microbatch else []
    names = broadcast_object_from_last_stage(names, groups)
    sums = torch.zeros(2 * len(names), dtype=torch.float64, device=collective_device(groups.sum_group))
    for metrics in per_microbatch or []:
        for i, name in enumerate(names):
            sums[2 * i] += metrics[name].loss_sum.double()
            sums[2 * i + 1] += metrics[name].count.double()
    if groups.is_last_stage and groups.sum_size > 1:
        dist.all_reduce(sums, group=groups.sum_group)
    sums = broadcast_from_last_stage(sums, groups)
    return {name: (sums[2 * i] / sums[2 * i + 1].clamp(min=1)).item() for i, name in enumerate(names)}


def broadcast_from_last_stage(tensor: Tensor, groups: ParallelGroups) -> Tensor:
    """The last pipeline stage's ``tensor`` on every stage (in place; same shape and dtype everywhere)."""
    if groups.pp_size > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(groups.pp_group, groups.pp_size - 1), group=groups.pp_group)
    return tensor


def broadcast_object_from_last_stage(obj, groups: ParallelGroups):
    """A picklable object from the last pipeline stage, on every stage: plain Python values only
    (names, numbers), never tensors (see ``share_stats``)."""
    if groups.pp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(groups.pp_group, groups.pp_size - 1), group=groups.pp_group
    )
    return box[0]


def train_step(
    ddp_models,
    optimizer,
    scheduler,
    microbatches: Sequence[MicroBatch],
    loss_fn: LossFunction,
    *,
    groups: ParallelGroups,
    fused_output: bool = False,
    guard: GradNormGuard | None = None,
    loss_units: LossUnits | None = None,
) -> StepResult:
    """One policy update: forward+backward over this DP rank's micro-batches, then the optimizer,
    unless ``guard`` refuses the step (``core.step_guard``: a non-finite loss or gradient norm, or
    a gradient-norm spike; the same decision on every rank): then the gradients are zeroed and
    neither the parameters, the optimizer's state nor the LR schedule change.

    The LR schedule steps first, so that a warmup counts the update it is applied to: the k-th
    update of a warmup of W runs at ``lr * k / W``, never at 0. A refused step does not count.

    Args:
        ddp_models: the policy's model chunks wrapped by ``optimizer.wrap_with_ddp``.
        microbatches: this DP rank's micro-batches (``MicroBatch``) with their old (and anchor) statistics,
            on the model's device. Their number may differ between DP ranks.
        loss_fn: the update-pass objective (``LossFunction``).
        fused_output: give ``loss_fn`` the output layer's input and weight (``OutputLayerInput``)
            instead of the logits (``train.fused_output_loss``; module docstring).
        guard: the run's refusal rule and gradient-norm history (``train.skip_grad_norm_factor``);
            an applied step's norm joins its history. None: non-finite steps only are refused.
        loss_units: the count ``loss_fn`` returns for a micro-batch, computed without the model
            (``parallel.rl_loss.loss_units``); needed by a mixture of experts with router losses,
            whose scale it sets (``mcore.moe.routing``). A mixture of experts adds ``moe/*`` metrics.
    """
    for model in ddp_models:
        model.train()
        model.zero_grad_buffer()
    optimizer.zero_grad()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = _model_forward(model, batch, fused_output=fused_output)
        return output, partial(_update_loss, batch, loss_fn, groups)

    set_aux_loss_scale(ddp_models[0].config, microbatches, loss_units, groups)
    recorder = router_recorder(ddp_models)
    with recorder.recording() if recorder is not None else contextlib.nullcontext():
        outputs = _run_schedule(ddp_models, microbatches, forward_step, forward_only=False)
    metrics = reduce_metrics(outputs if groups.is_last_stage else None, groups)
    if recorder is not None:
        metrics.update(recorder.reduce(groups))
    guard = guard if guard is not None else GradNormGuard(factor=None)
    found_inf = optimizer.prepare_grads()  # the main gradients; True only under a loss scaler
    grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
    loss = metrics.get("loss", 0.0)  # a global mean: the same on every rank
    reason, grad_norm, threshold = _agree(guard.decide(loss, grad_norm), grad_norm, guard.threshold())
    if reason != SkipReason.NONE:
        for model in ddp_models:  # nothing of the refused gradients reaches the next step
            model.zero_grad_buffer()
        optimizer.zero_grad()
        why = guard.describe(reason, loss, grad_norm, threshold)
        return StepResult(metrics, grad_norm, optimizer.param_groups[0]["lr"], skipped=why)
    guard.record(grad_norm)
    scheduler.step(increment=1)
    lr = optimizer.param_groups[0]["lr"]
    # Megatron's own step, as without the guard: its prepare_grads copies the same gradients again
    # (idempotent without a loss scaler: build_optimizer makes bf16 or fp32 optimizers) and its
    # clipping computes the same norm
    optimizer.step()
    return StepResult(metrics, grad_norm, lr)


def _agree(reason: SkipReason, grad_norm: float, threshold: float | None) -> tuple[SkipReason, float, float | None]:
    """Every rank's most severe ``reason``, one gradient norm for all (NaN if one rank's is, else
    inf if one rank's is, else the largest) and the largest spike ``threshold`` (None: no rank has
    one), by one all-reduce with MAX over the training world: every rank refuses or applies the
    step alike, says why in the same words and records the same norm in its guard's history
    (which a checkpoint holds: the same on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reason, grad_norm, threshold
    finite = grad_norm if math.isfinite(grad_norm) else 0.0
    values = torch.tensor(
        [float(reason), finite, math.isnan(grad_norm), math.isinf(grad_norm), threshold or 0.0],
        dtype=torch.float64,
        device=collective_device(),
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    code, finite, nan, inf, threshold = values.tolist()
    return SkipReason(int(code)), float("nan") if nan else float("inf") if inf else finite, threshold or None
