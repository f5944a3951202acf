"""The distillation teacher's part of a step, one class per ``algorithm.distill.placement``
(``trainer.bind.distill.PLACEMENTS``, chosen once at bind): after the old and anchor passes the
loop calls ``teacher.stats(micro, forward_stats)``, which leaves every micro-batch's
``teacher_logprobs`` / ``teacher_topk_ids`` / ``teacher_topk_logprobs`` filled (``core.microbatch``):

    trainer   a forward pass of the frozen Megatron teacher on the training ranks (``mcore.teacher``),
              its log-probs and top-k from the vocab-parallel kernels;
    engine    nothing to compute: the teacher engines scored the samples in the rollout
              (``trainer.engines.teacher``) and batching put their scores in; it checks they are there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_empg.core.microbatch import MicroBatch, StatsResult

if TYPE_CHECKING:
    from megatron_empg.mcore.teacher import FrozenTeacher
    from megatron_empg.trainer.bind.build import Components

ForwardStats = Callable[..., list[StatsResult]]  # (models, micro, request) -> one StatsResult per micro-batch


class TrainerTeacher:
    """``placement: trainer``: the teacher's forward pass on the training ranks."""

    def __init__(self, teacher: FrozenTeacher, *, vocab_size: int, k: int, chunk_size: int | None) -> None:
        self.teacher, self.vocab_size, self.k, self.chunk_size = teacher, vocab_size, k, chunk_size

    @classmethod
    def build(cls, components: Components, groups) -> TrainerTeacher:
        from megatron_empg.trainer.policy import build_teacher

        return cls(
            build_teacher(components, groups),
            vocab_size=components.model.vocab_size,
            k=components.distill.term.teacher_k,
            chunk_size=components.config.algorithm.loss.chunk_size,
        )

    def stats(self, micro: list[MicroBatch], forward_stats: ForwardStats) -> None:
        """log pi_teacher at the targets ([B, S] float32) and the teacher's top-k ids ([B, S, k]
        int64) and log-probs ([B, S, k] float32) into each of ``micro``."""
        from megatron_empg.mcore.step import StatsRequest

        request = StatsRequest(vocab_size=self.vocab_size, k=self.k, with_entropy=False, chunk_size=self.chunk_size)
        with self.teacher.forward_models() as models:
            outs = forward_stats(models, micro, request)
        for mb, out in zip(micro, outs):
            mb.teacher_logprobs = out.logprobs
            mb.teacher_topk_ids, mb.teacher_topk_logprobs = out.topk_ids, out.topk_logprobs


class EngineTeacher:
    """``placement: engine``: the micro-batches arrive with the teacher engines' scores."""

    @classmethod
    def build(cls, components: Components, groups) -> EngineTeacher:
        return cls()

    def stats(self, micro: list[MicroBatch], forward_stats: ForwardStats) -> None:
        """Checks that every micro-batch carries the teacher's fields (``Sample.teacher``)."""
        for mb in micro:
            if mb.teacher_logprobs is None or mb.teacher_topk_ids is None or mb.teacher_topk_logprobs is None:
                raise RuntimeError("placement engine: a micro-batch came without the teacher engine's scores")


TEACHERS: dict[str, type[TrainerTeacher] | type[EngineTeacher]] = {"trainer": TrainerTeacher, "engine": EngineTeacher}


def build_teacher(components: Components, groups) -> TrainerTeacher | EngineTeacher | None:
    """The teacher of ``components.distill``'s placement, or None without distillation."""
    binding = components.distill
    return None if binding is None else TEACHERS[binding.placement.name].build(components, groups)
