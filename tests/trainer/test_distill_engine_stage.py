"""The rollout stage with a distillation teacher engine (``placement: engine``): the owner scores
prompt + response of every sample after generating (``TeacherEngine.score``, ``[P][n]`` scores in
the trajectories' order) and the samples carry them; a teacher engine that fails inside the rollout
fails the rollout (``EngineLost``), as the rollout engine's own failure does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_empg.config import RunConfig, load_config
from megatron_empg.parallel.placement import EnginePlacement
from megatron_empg.rollout.engine import Completion, EngineFailure, TopkScores
from megatron_empg.trainer.engines.rollout import EngineLost, RolloutStage
from tests.trainer.demo_runs import DEMO_RECIPE

PROMPTS = [[3, 4], [5], [6, 7, 8]]


class ScriptedEngine:
    """Response j of prompt [a, ...] is [a + j, a + j + 1]."""

    def check_health(self) -> None:
        pass

    def generate(self, prompts, sampling, **_):
        return [
            [Completion([p[0] + j, p[0] + j + 1], [-0.5, -0.5], "stop", None) for j in range(sampling.n)]
            for p in prompts
        ]


class ScriptedTeacher:
    """Scores sequence s (all tokens) with target[t] = -s[t + 1], ids (s[t + 1], 0), or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def check_health(self) -> None:
        pass

    def score(self, prompts, trajectories):
        if self.fail:
            raise EngineFailure("the teacher engine's core died")
        self.calls.append(len(prompts))
        out = []
        for prompt, group in zip(prompts, trajectories):
            out.append([])
            for t in group:
                nxt = torch.tensor((list(prompt) + t.token_ids)[1:])
                out[-1].append(TopkScores(torch.stack([nxt, 0 * nxt], -1), torch.zeros(len(nxt), 2), -nxt.float()))
        return out


def _stage(teacher) -> RolloutStage:
    config = load_config(
        RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", "tokenizer=/tmp", "rollout.sampling.n=2"]
    )
    stage = RolloutStage.__new__(RolloutStage)  # one engine, no process group: what sample reads
    stage.config, stage.engine, stage.agent = config, ScriptedEngine(), None
    stage.teacher, stage._teacher_factory = teacher, lambda: teacher
    stage.placement = EnginePlacement(
        num_engines=1,
        engine=0,
        owners=(0,),
        members=((0,),),
        group=None,
        feeds_engine=True,
        rank=0,
        node_slot=0,
        node_slots=1,
        local_rank=0,
    )
    return stage


def test_the_samples_carry_their_teacher_scores():
    teacher = ScriptedTeacher()
    (samples,), metrics = _stage(teacher).sample(0, [SimpleNamespace(prompt_ids=p) for p in PROMPTS], dp_size=1)
    assert teacher.calls == [3] and len(samples) == 6
    for s in samples:
        tokens = s.prompt_ids + s.response_ids
        assert s.teacher.target.tolist() == [-float(x) for x in tokens[1:]]  # its own sequence's
        assert s.teacher.ids[:, 0].tolist() == tokens[1:]
    assert samples[1].response_ids == [PROMPTS[0][0] + 1, PROMPTS[0][0] + 2]  # sample order kept
    assert metrics["engines/teacher_seconds_max"] >= 0


def test_a_teacher_engine_failure_fails_the_rollout():
    with pytest.raises(EngineLost, match="the teacher engine's core died"):
        _stage(ScriptedTeacher(fail=True)).sample(0, [SimpleNamespace(prompt_ids=p) for p in PROMPTS], dp_size=1)
