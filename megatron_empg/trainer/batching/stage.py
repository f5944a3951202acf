"""The batching stage of a step: the samples of this rank's engine -> this replica's mini-batches
of micro-batches on the policy's device (``trainer.batching.batch`` does the layout).

Every rank holds the samples of all R replicas its engine serves (``trainer.engines.rollout``), but only
its own replica's advantages. With ``train.balance`` and R > 1 the advantages are shared inside
the engine group first (one all-gather), then each mini-batch's samples are split between the R
replicas by estimated compute (``batch.replica_shares``, cost ``balance.sequence_cost`` with the
model's attention term); every rank computes the same split. Samples that do not train are left
out; the rest become micro-batches as ``train.packing`` / ``max_tokens_per_microbatch`` /
``micro_batch_size`` say, one shape per call under pipeline parallelism. Under context
parallelism every sequence is padded to a multiple of 2 x CP, the budget is per CP rank (a full
row holds CP x as many tokens), and each rank keeps its share of every row
(``parallel.context_parallel.split_microbatch``). The forward-only passes run on them, or with
``max_tokens_per_forward_microbatch`` on rows of them back to back (``forward_plan``,
``trainer.batching.forward_batch``).

    stage = BatchStage(config, model, placement, groups, pad_id=...)
    batch = stage.build(replicas, advantages, device=...)   # StepBatch
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from megatron_empg.config import ModelConfig, RunConfig
from megatron_empg.core.behavior_is import BEHAVIOR_STATS, behavior_stats, behavior_weights
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.parallel.collectives import collective_device
from megatron_empg.parallel.context_parallel import split_microbatch
from megatron_empg.parallel.placement import EnginePlacement
from megatron_empg.trainer.batching.balance import attention_quadratic, imbalance, sequence_cost
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches, replica_shares
from megatron_empg.trainer.batching.forward_batch import ForwardPlan, forward_groups
from megatron_empg.trainer.bind.layout import row_multiple


@dataclasses.dataclass
class StepBatch:
    """This replica's ``[mini-batch][micro-batch]`` of one step on the policy's device, with its
    ``tokens`` (of the samples in them), ``slots`` (positions computed, padding included),
    ``imbalance`` (max / mean tokens over the replicas of this rank's engine; 1: balanced) and
    ``forward_micro_batches`` (the old and anchor passes' micro-batches each, ``forward_plan``)."""

    minis: list[list[MicroBatch]]
    tokens: int
    slots: int
    imbalance: float
    forward_micro_batches: int

    def sampler_gap(self) -> tuple[float, int]:
        """(sum, count) of |log pi_old - the engine's log-prob| over the loss tokens, after the old
        pass: how far the trainer's policy and the engine's sampling disagree (0 with exact weights
        and numerics)."""
        total, count = 0.0, 0
        for mb in (mb for mini in self.minis for mb in mini):
            gap = (mb.old_logprobs - mb.sampler_logprobs).abs()
            total += float(torch.where(mb.loss_mask, gap, 0.0).sum())
            count += int(mb.loss_mask.sum())
        return total, count

    def behavior_is(self, mode: str, cap: float) -> dict[str, float]:
        """After the old pass: each micro-batch's ``behavior_weights`` of ``mode`` (a name of
        ``core.behavior_is.BEHAVIOR_IS``; ``none`` leaves them None) with cap ``cap``, and the sums
        of ``behavior_stats`` over this replica's micro-batches (for every mode; zeros without any)."""
        totals = dict.fromkeys(BEHAVIOR_STATS, 0.0)
        for mb in (mb for mini in self.minis for mb in mini):
            mb.behavior_weights = behavior_weights(mb.old_logprobs, mb.sampler_logprobs, mb.loss_mask, mode, cap)
            for name, value in behavior_stats(mb.old_logprobs, mb.sampler_logprobs, mb.loss_mask, cap).items():
                totals[name] += value
        return totals


class BatchStage:
    """What one rank needs to build its micro-batches each step (module docstring). ``groups``:
    Megatron's (``mcore.parallel_state.ParallelGroups``)."""

    def __init__(self, config: RunConfig, model: ModelConfig, placement: EnginePlacement, groups, *, pad_id: int):
        self.config, self.placement = config, placement
        self.replicas = groups.dp_size // placement.num_engines  # R: the replicas of one engine
        self.replica = groups.dp_rank % self.replicas  # this rank's among them
        self.cp_size, self.cp_rank = groups.cp_size, groups.cp_rank
        train, parallel = config.train, config.parallel
        pp = parallel.pipeline_model_parallel_size
        count_multiple = pp if parallel.virtual_pipeline_model_parallel_size else 1
        budget = train.max_tokens_per_microbatch  # per context-parallel rank: a full row holds CP x as many
        self.plan = MicroBatchPlan(
            packing=train.packing,
            micro_batch_size=train.micro_batch_size,
            max_tokens=None if budget is None else budget * self.cp_size,
            fixed_shape=pp > 1,
            count_multiple=count_multiple,
            pad_multiple=row_multiple(parallel),
            pad_id=pad_id,
            segment_multiple=2 * self.cp_size if self.cp_size > 1 else 1,
            routing=(model.num_layers, model.moe_router_topk) if config.algorithm.router_replay == "rollout" else None,
        )
        self.forward_plan = ForwardPlan(
            max_tokens=train.max_tokens_per_forward_microbatch, fixed_shape=pp > 1, count_multiple=count_multiple
        )
        quadratic = attention_quadratic(model.hidden_size, model.parameters_per_layer())
        balance = train.balance and self.replicas > 1
        self.cost = functools.partial(sequence_cost, quadratic=quadratic) if balance else None

    def build(self, replicas: list[list[Sample]], advantages: torch.Tensor, *, device: torch.device) -> StepBatch:
        """This replica's micro-batches of ``replicas`` ([R][B] samples of this rank's engine) and
        ``advantages`` ([B] float32, this replica's samples). Marks each sample's ``trains``
        (``algorithm.mask_truncated``); every rank of the engine group calls it together."""
        mask_truncated = self.config.algorithm.mask_truncated
        for sample in (s for replica in replicas for s in replica):
            sample.trains = bool(sample.generated_ids) and not (mask_truncated and sample.finish_reason == "length")
        if self.cost is not None:
            advantages_of = self._engine_advantages(advantages)
        else:
            advantages_of = {self.replica: advantages.tolist()}
        shares = replica_shares(
            [[s.length for s in r] for r in replicas],
            [[s.trains for s in r] for r in replicas],
            mini_batches=self.config.algorithm.mini_batches,
            cost=self.cost,
        )
        minis = []
        for items in shares[self.replica]:
            calls = micro_batches(
                [replicas[r][i] for r, i in items], [advantages_of[r][i] for r, i in items], self.plan
            )
            minis.append([split_microbatch(mb, self.cp_size, self.cp_rank).to(device) for mb in calls])
        tokens = [sum(replicas[r][i].length for mini in share for r, i in mini) for share in shares]
        slots = sum(mb.input_ids.numel() for mini in minis for mb in mini)
        forward = forward_groups([mb.shape[1] for mini in minis for mb in mini], self.forward_plan)
        return StepBatch(minis, tokens[self.replica], slots, imbalance(tokens), len(forward))

    def _engine_advantages(self, advantages: torch.Tensor) -> dict[int, list[float]]:
        """``{r: [B] advantages}`` of the R replicas of this rank's engine, from one all-gather
        inside its group (each rank sends its replica index and its [B] advantages)."""
        group = self.placement.group
        row = torch.cat([torch.tensor([float(self.replica)]), advantages.double()]).to(collective_device(group))
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, row, group=group)
        out = {int(r[0]): r[1:].tolist() for r in rows}
        if sorted(out) != list(range(self.replicas)):
            raise RuntimeError(
                f"engine group advantages came from replicas {sorted(out)}, expected 0..{self.replicas - 1}"
            )
        return out
