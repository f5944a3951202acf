"""A step's rollout, collected where the engines are: on the training ranks (colocated engines)
or on the engine ranks (disaggregated, ``trainer.engines.engine_rank``).

``RolloutCollector.collect`` draws the data cursor's next global prompt batch through the
rollout stage and scores it, or with ``algorithm.dynamic_sampling`` as many batches as it takes
(``trainer.engines.dynamic_sampling``). ``Scorer`` is the reward of ``data.reward`` with DAPO's overlong
penalty, within the step's ``data.reward_budget_s`` (counted over all of the step's generation batches).

    collector = RolloutCollector(config, stage, batches, scorer, dp_size=D)
    rollout = collector.collect(times)   # StepRollout: [R] replicas of this rank's engine
"""

from __future__ import annotations

import dataclasses
import logging
import time

from megatron_empg.config import RunConfig
from megatron_empg.rollout.rewards import RewardFn, RewardLimits, WorkerReward, overlong_penalty, score_guarded
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.dynamic_sampling import DynamicSampler, dynamic_batch_prompts
from megatron_empg.trainer.engines.sums import sample_sums

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepRollout:
    """A step's rollout: ``replicas`` ([R][samples], scored) of one engine's replicas (of all D
    replicas when the engines are disaggregated), each replica's ``sums`` ([R]: the
    ``trainer.engines.metrics.sample_sums`` of what it drew, with dynamic sampling its dropped groups too
    and the ``dynamic_sampling/*`` counts), the ``metrics`` that are the same on every rank
    (``engines/*``, ``dynamic_sampling/gen_batches``), the weight ``version`` that drew it (the
    optimizer steps' count of training steps done), and the data cursor's state after it."""

    replicas: list[list[Sample]]
    sums: list[dict[str, float]]
    metrics: dict[str, float]
    version: int = 0
    data_state: dict | None = None


class Scorer:
    """Each sample's reward (``data.reward``, then ``algorithm.overlong_buffer``'s penalty) and
    whether it is correct; returns the reward's metric sums as ``reward/*``. A ``WorkerReward``
    gets ``data.reward_workers``, ``reward_timeout_s`` and the deadline of ``reward_budget_s``;
    with a budget, ``reward/unscored`` counts the samples it left unscored (every rank has the key).
    A sample whose reward raises or is not a finite number scores 0 and counts in ``reward/errors``
    (``rollout.rewards.score_guarded``); the first such sample of a step is logged with its
    traceback (``new_step`` starts a step)."""

    def __init__(self, config: RunConfig, tokenizer, reward_fn: RewardFn | WorkerReward) -> None:
        self.config, self.tokenizer, self.reward_fn = config, tokenizer, reward_fn
        self._error_logged = False  # this step's first bad sample is logged, the others counted

    def new_step(self) -> None:
        """A step (or a validation pass) starts: its first bad sample will be logged."""
        self._error_logged = False

    def __call__(self, samples: list[Sample], spent_s: float = 0.0) -> dict[str, float]:
        """Score ``samples``; ``spent_s``: seconds of ``data.reward_budget_s`` the step's earlier
        calls took (0: the whole budget is left)."""
        start = time.monotonic()
        data = self.config.data
        texts = self.tokenizer.batch_decode([s.generated_ids for s in samples], skip_special_tokens=True)
        examples = [s.example for s in samples]
        if isinstance(self.reward_fn, WorkerReward):
            budget = data.reward_budget_s
            deadline = None if budget is None else start + max(budget - spent_s, 0.0)
            limits = RewardLimits(data.reward_workers, data.reward_timeout_s, deadline)
            result, error = score_guarded(lambda r, e: self.reward_fn(r, e, limits), texts, examples)
        else:
            result, error = score_guarded(self.reward_fn, texts, examples, timeout_s=data.reward_timeout_s)
        if error is not None and not self._error_logged:
            self._error_logged = True
            log.warning(
                "%s\n(scored 0 and counted in reward/errors; later bad samples of this step are counted only)", error
            )
        for sample, score, correct in zip(samples, result.scores, result.correct):
            sample.reward, sample.correct = float(score), bool(correct)
        metrics = {f"reward/{k}": float(v) for k, v in result.metrics.items()}
        if data.reward_budget_s is not None:
            metrics.setdefault("reward/unscored", 0.0)
        algorithm = self.config.algorithm
        if algorithm.overlong_buffer:
            penalties = [
                overlong_penalty(
                    len(s.response_ids),
                    max_length=self.config.rollout.sampling.max_tokens,
                    buffer=algorithm.overlong_buffer,
                    factor=algorithm.overlong_penalty,
                )
                for s in samples
            ]
            for sample, penalty in zip(samples, penalties):
                sample.reward += penalty
            metrics["reward/overlong_penalty"] = sum(penalties)
        return metrics


class RolloutCollector:
    """What a step's rollout needs: the rollout stage (``trainer.engines.rollout.RolloutStage``), the data
    cursor (``rollout.data.PromptBatches``: global batches), the scorer and D, the data-parallel
    size of the training ranks. ``replica``: the one replica of the engine's whose samples this
    rank scores without dynamic sampling (None: all; the others' sums stay empty). Every rank of
    the stage's world calls ``collect`` together."""

    def __init__(
        self, config: RunConfig, stage, batches, scorer: Scorer, *, dp_size: int, replica: int | None = None
    ) -> None:
        self.stage, self.batches, self.scorer, self.dp_size = stage, batches, scorer, dp_size
        self.replica = replica
        dynamic = config.algorithm.dynamic_sampling
        replicas = dp_size // stage.placement.num_engines
        self.sampler = (
            None
            if dynamic is None
            else DynamicSampler(dynamic, quota=config.train.prompts_per_step // dp_size, replicas=replicas)
        )

    def collect(self, times: dict[str, float]) -> StepRollout:
        """This step's samples of each replica of this rank's engine, scored; scoring time goes
        to ``times["rewards"]``."""
        self.scorer.new_step()
        engine_metrics: list[dict[str, float]] = []

        def draw(_: int) -> list[list[Sample]]:
            index = self.batches.cursor
            replicas, metrics = self.stage.sample(index, next(self.batches), dp_size=self.dp_size)
            engine_metrics.append(metrics)
            return replicas

        spent_s = 0.0  # this step's scoring so far, against data.reward_budget_s

        def score(samples: list[Sample]) -> dict[str, float]:
            nonlocal spent_s
            start = time.perf_counter()
            try:
                return self.scorer(samples, spent_s)
            finally:
                seconds = time.perf_counter() - start
                spent_s += seconds
                times["rewards"] = times.get("rewards", 0.0) + seconds

        version = self.stage.weights_version
        if self.sampler is None:
            replicas = draw(0)
            sums = [
                sample_sums(samples, score(samples)) if self.replica in (None, r) else {}
                for r, samples in enumerate(replicas)
            ]
            return StepRollout(replicas, sums, engine_metrics[0], version, self.batches.state_dict())
        collected = self.sampler.collect(draw, score)
        metrics = {**merge_engine_metrics(engine_metrics), "dynamic_sampling/gen_batches": float(collected.gen_batches)}
        return StepRollout(collected.replicas, collected.sums, metrics, version, self.batches.state_dict())


def prompt_batches(config: RunConfig, tokenizer):
    """The data cursor over ``data``'s prompts: global batches of a step's prompts, or of
    ``algorithm.dynamic_sampling.prompts_per_gen_batch`` (``rollout.data.PromptBatches``)."""
    from megatron_empg.rollout.data import PromptBatches
    from megatron_empg.tasks.registry import build_prompt_source

    source = build_prompt_source(config.data, tokenizer)
    size = dynamic_batch_prompts(config.algorithm.dynamic_sampling, config.train.prompts_per_step)
    return PromptBatches(source, batch_size=size)


def validation_sets(config: RunConfig, tokenizer) -> dict:
    """``validation.files`` as prompt examples per data source (none: empty)."""
    from megatron_empg.rollout.data import load_validation_sets

    validation = config.validation
    if not validation.files:
        return {}
    return load_validation_sets(config.data, validation.files, tokenizer, validation.max_prompts_per_source)


def merge_engine_metrics(batches: list[dict[str, float]]) -> dict[str, float]:
    """The ``engines/*`` metrics of a step that drew several generation batches: seconds, samples
    and tokens add up; the engine count and which engine was slowest are the last batch's."""
    merged = dict(batches[-1])
    for key in merged:
        if key not in ("engines/count", "engines/slowest", "engines/slowest_share"):
            merged[key] = sum(b[key] for b in batches)
    return merged
