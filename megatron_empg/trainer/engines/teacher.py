"""A distillation teacher served by an engine (``algorithm.distill.placement: engine``).

Each engine owner (``parallel.placement``) starts one teacher engine beside its rollout engine, of
the same kind (``rollout.engine``) and from ``teacher.checkpoint`` (a Hugging Face directory), in
``teacher.dtype``, with ``teacher.gpu_memory_utilization`` of the GPU (vLLM). After each generation the owner scores prompt + response of every sample with
it (``RolloutEngine.score_topk``: the teacher's log-prob of each sampled token and its top-k ids
and log-probs at every position, vLLM's ``prompt_logprobs=k``), before the samples are shared in
the engine group; ``Sample.teacher`` carries them into the micro-batches' ``teacher_*``
(``trainer.batching.batch``). The teacher never takes weights. Where the run colocates an engine
with training on a GPU (``rollout.sleep_while_training``) it sleeps (level 1) between its calls.
A vLLM teacher runs in its own process: two in-process vLLM engines cannot share one.

    teacher = TeacherEngine(config, ENGINES["hf"], k=8, max_model_len=129)
    scores = teacher.score(prompts, trajectories)   # [P][n] TopkScores
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from megatron_empg.config import RunConfig
from megatron_empg.rollout.engine import TopkScores
from megatron_empg.rollout.engines import EngineKind
from megatron_empg.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


class TeacherEngine:
    """The teacher of ``config.algorithm.distill`` in an engine of ``kind``; ``k``: the top-k it
    returns per position (``DistillTerm.teacher_k``); ``max_model_len``: its context, the longest
    sample + 1 (``DistillBinding.context``)."""

    def __init__(self, config: RunConfig, kind: EngineKind, k: int, *, max_model_len: int) -> None:
        spec = config.algorithm.distill.teacher
        self.k = k
        self.sleeps = config.rollout.sleep_while_training
        rollout = dataclasses.replace(
            config.rollout,
            dtype=spec.dtype,
            in_process=config.rollout.in_process and not kind.own_process,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            max_model_len=max_model_len,
        )
        log.info("distillation teacher engine %s from %s (%s, top-%d)", kind.target, spec.checkpoint, spec.dtype, k)
        self.engine = kind.load()(spec.checkpoint, rollout, load_format="auto", max_logprobs=k)
        if self.sleeps:
            self.engine.sleep(level=1)

    def score(
        self, prompts: Sequence[Sequence[int]], trajectories: Sequence[Sequence[Trajectory]]
    ) -> list[list[TopkScores]]:
        """``[P][n]`` teacher scores of ``prompts[p] + trajectories[p][j].token_ids`` (``L - 1``
        positions each, ``L`` the sequence's tokens)."""
        sequences = [list(prompt) + t.token_ids for prompt, group in zip(prompts, trajectories) for t in group]
        if self.sleeps:
            self.engine.wake_up()
        try:
            flat = iter(self.engine.score_topk(sequences, self.k))
        finally:
            if self.sleeps:
                self.engine.sleep(level=1)
        return [[next(flat) for _ in group] for group in trajectories]

    def check_health(self) -> None:
        self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()
