"""DAPO's dynamic sampling (``algorithm.dynamic_sampling``): the groups of a step that carry an
advantage, collected over as many generation batches as it takes.

A group whose responses all score the same (``metric``: ``acc`` all correct or all wrong,
``reward`` one reward) has a zero advantage under any group baseline, so it trains nothing but
the KL term. Each generation batch (``prompts_per_gen_batch`` prompts, the data cursor's next) is
sampled by the engines as a step's batch would be; every rank scores the samples of all the
replicas its engine serves (rewards are deterministic: the ranks of one engine agree) and keeps
each replica's informative groups. One MAX all-reduce over the world per batch says whether some
replica still lacks groups. At the end each replica takes its first ``quota`` kept groups, and if
``max_num_gen_batches`` ran out, the dropped groups fill the rest (the run goes on; a warning says
how many). Groups are renumbered 0.. within the replica, as a step's prompt indices are.

    collector = DynamicSampler(settings, quota=prompts_per_step // dp, replicas=R)
    result = collector.collect(draw, score)   # draw(k) -> [R][samples] of batch k; score(samples)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_empg.config import DynamicSamplingConfig
from megatron_empg.parallel.collectives import collective_device
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.sums import add_sums, sample_sums

log = logging.getLogger(__name__)

Group = list[Sample]


def dynamic_batch_prompts(settings: DynamicSamplingConfig | None, prompts_per_step: int) -> int:
    """Prompts per generation batch: ``prompts_per_gen_batch``, else a step's."""
    if settings is None or settings.prompts_per_gen_batch is None:
        return prompts_per_step
    return settings.prompts_per_gen_batch


def split_groups(samples: Sequence[Sample]) -> list[Group]:
    """``samples`` as their groups (consecutive samples of one ``group``), in order."""
    groups: list[Group] = []
    for sample in samples:
        if groups and groups[-1][0].group == sample.group:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def informative(group: Group, metric: str) -> bool:
    """Whether ``group``'s responses differ in ``metric`` (``acc``: correctness, ``reward``: the
    reward), so that a group baseline leaves them a non-zero advantage. A group of one never does."""
    values = {s.correct for s in group} if metric == "acc" else {s.reward for s in group}
    return len(values) > 1


@dataclasses.dataclass
class Collected:
    """What ``DynamicSampler.collect`` returns: ``replicas`` ([R][quota x n] samples, groups
    renumbered); for each replica the ``sample_sums`` of every sample it drew (kept or not: what
    the policy sampled: rewards and the ``reward/*`` sums) with its group counts
    (``dynamic_sampling/*``: informative, drawn, filled), ``[R]``; ``gen_batches`` drawn (the same
    on every rank)."""

    replicas: list[list[Sample]]
    sums: list[dict[str, float]]
    gen_batches: int


class DynamicSampler:
    """Collects ``quota`` informative groups for each of the R replicas of this rank's engine."""

    def __init__(self, settings: DynamicSamplingConfig, *, quota: int, replicas: int, group=None):
        self.settings, self.quota, self.replicas = settings, quota, replicas
        self.group = group  # the world's process group (None: the default one)

    def collect(self, draw: Callable[[int], list[list[Sample]]], score: Callable[[list[Sample]], dict]) -> Collected:
        """``draw(k)``: the samples of generation batch k (0-based within this step) of each
        replica, ``[R][...]``; ``score(samples)``: sets their rewards and correctness and returns
        their ``reward/*`` sums. Every rank of the world calls it together."""
        kept: list[list[Group]] = [[] for _ in range(self.replicas)]
        dropped: list[list[Group]] = [[] for _ in range(self.replicas)]
        sums: list[dict[str, float]] = [{} for _ in range(self.replicas)]
        batches = 0
        while True:
            replicas = draw(batches)
            batches += 1
            for r, samples in enumerate(replicas):
                add_sums(sums[r], sample_sums(samples, score(samples)))
                for group in split_groups(samples):
                    (kept if informative(group, self.settings.metric) else dropped)[r].append(group)
            missing = self._world_max(max(max(self.quota - len(groups), 0) for groups in kept))
            if missing == 0 or batches == self.settings.max_num_gen_batches:
                break
        filled = [max(self.quota - len(groups), 0) for groups in kept]
        if any(filled):
            log.warning(
                "dynamic sampling: %d generation batches left replica(s) %s short of %d informative groups; "
                "filled with %s groups that all scored the same (no policy gradient)",
                batches,
                [r for r, f in enumerate(filled) if f],
                self.quota,
                filled,
            )
        chosen = [kept[r][: self.quota] + dropped[r][: filled[r]] for r in range(self.replicas)]
        out = [[dataclasses.replace(s, group=g) for g, group in enumerate(groups) for s in group] for groups in chosen]
        for r in range(self.replicas):  # summed over replicas with the step's other metrics
            sums[r].update(
                {
                    "dynamic_sampling/informative_groups": float(len(kept[r])),
                    "dynamic_sampling/drawn_groups": float(len(kept[r]) + len(dropped[r])),
                    "dynamic_sampling/filled_groups": float(filled[r]),
                }
            )
        return Collected(out, sums, batches)

    def _world_max(self, value: int) -> int:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=collective_device(self.group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())
