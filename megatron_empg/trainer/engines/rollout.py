"""The rollout stage: the engines of a run (``parallel.placement``), what they sample each step and
for validation, and their sleep and wake-up around training.

Engine ``e`` samples the prompts of its replicas: a consecutive block of each global batch (GRPO
groups whole). Seeds follow the global prompt index (``rollout.sampling.seed`` + step offset +
first prompt x n, times the search agent's turns per episode), so E engines draw what one engine
would. Each owner shares its trajectories inside its engine group only, so every rank holds the
samples of all the replicas its engine serves (the trainer balances them between those replicas). Validation prompts split over the engines the same way, and their metric sums
are reduced once over the world. With a distillation teacher on the engines
(``algorithm.distill.placement: engine``, ``trainer.engines.teacher``) each owner scores its
trajectories with it before sharing them: the samples carry the teacher's scores.

    stage = RolloutStage(config, model, tokenizer, engine_kind, placement, run_dir=...)  # every rank
    replicas, metrics = stage.sample(step, examples, dp_size=...)   # [R][samples of a replica]
    stage.sleep(); ...; stage.wake_weights(); <sync>; stage.wake_kv_cache()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_empg.config import ModelConfig, RunConfig, SamplingConfig
from megatron_empg.parallel.placement import EnginePlacement
from megatron_empg.rollout.engine import EngineFailure
from megatron_empg.rollout.engines import EngineKind
from megatron_empg.rollout.trajectory import Trajectory
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.restart_budget import RestartBudget
from megatron_empg.trainer.engines.sums import add_sums, sample_means, sample_sums
from megatron_empg.trainer.engines.teacher import TeacherEngine
from megatron_empg.trainer.run.signals import ignored_in_children
from megatron_empg.trainer.run.start import write_hf_config
from megatron_empg.trainer.run.watchdog import RestartableError

log = logging.getLogger(__name__)

RewardScorer = Callable[[list[Sample]], dict[str, float]]  # sets each sample's reward; returns reward/* sums


class EngineLost(RestartableError):
    """Engines that failed inside a rollout (``engines``: their indices), raised on every rank of
    the stage's world together; ``restart_engines`` starts them again, or the run exits restartable."""

    def __init__(self, engines: list[int], reason: str) -> None:
        super().__init__(f"engine(s) {engines} lost inside a rollout: {reason}")
        self.engines = engines


class RolloutStage:
    """The engines and their work. The owner of each engine (``placement.is_owner``) holds it in
    ``engine`` (None elsewhere), with the search agent of ``rollout.search_agent``; every rank
    calls ``sample`` and ``validate`` together."""

    weights_version = 0  # training steps done when the engines got their weights (the sync sets it)
    between_steps: Callable[[], None] | None = None  # rollout.partial: given to the engine's generate by `sample`
    teacher: TeacherEngine | None = None  # the owner's distillation teacher engine (placement: engine)
    _teacher_factory: Callable[[], TeacherEngine] | None = None  # what starts it (every rank: its payload has scores)

    def __init__(
        self,
        config: RunConfig,
        model: ModelConfig,
        tokenizer,
        engine_kind: EngineKind,
        placement: EnginePlacement,
        *,
        run_dir: Path,
        teacher: Callable[[], TeacherEngine] | None = None,
    ) -> None:
        self.config, self.placement = config, placement
        self._teacher_factory = teacher
        self.model_dir = run_dir / f"engine_model_{placement.engine}"
        self.agent = self._build_agent(model, tokenizer) if placement.is_owner and config.rollout.search_agent else None
        self._engine_args = (model, tokenizer, engine_kind)
        self.engine = self._start(*self._engine_args) if placement.is_owner else None
        self.teacher = self._start_teacher() if placement.is_owner else None
        self.asleep = False
        self.restarts = RestartBudget(run_dir, config.rollout.engine_restarts)  # over the run's attempts

    # ------------------------------------------------------------------ setup

    def _start(self, model: ModelConfig, tokenizer, engine_kind: EngineKind):
        """This owner's engine, from dummy weights (the first sync brings the policy's); with
        ``weight_sync.lora_mode: adapter``, from the base's weights (syncs bring adapters only)."""
        self.model_dir.mkdir(parents=True, exist_ok=True)
        write_hf_config(model, self.model_dir)
        tokenizer.save_pretrained(self.model_dir)
        rollout = self.config.rollout
        start = {"load_format": "dummy"}
        if self.config.weight_sync.lora_mode == "adapter":
            _link_base_weights(self.config.checkpoint.init_from, self.model_dir)
            start = {"load_format": "auto", "lora": model.lora}
        environment = self._environment()
        log.info(
            "engine %d of %d on rank %d%s",
            self.placement.engine,
            self.placement.num_engines,
            self.placement.rank,
            "".join(f", {k}={v}" for k, v in environment.items()),
        )
        # The engine's processes (rollout.in_process=false) keep SIGTERM and SIGUSR1 blocked: torchrun
        # and Slurm signal whole process groups, and the trainer, which takes both as "checkpoint after
        # this step", still needs the engine for the step in flight. It ends the engine itself, with
        # SIGINT (VllmEngine.shutdown).
        with ignored_in_children(), child_environment(environment):
            routing = {"routed_experts": True} if self.config.algorithm.router_replay == "rollout" else {}
            return engine_kind.load()(self.model_dir, rollout, **start, **routing)

    def _environment(self, *, own_process: bool = False) -> dict[str, str]:
        """The environment of this owner's engine processes (none in process, unless ``own_process``)."""
        rollout = self.config.rollout
        if rollout.in_process and not own_process:
            return {}
        return engine_environment(self.placement, rollout.tensor_parallel_size, shares_node=rollout.disaggregated)

    def _start_teacher(self) -> TeacherEngine | None:
        """The distillation teacher's engine beside this owner's (``placement: engine``), or None."""
        if self._teacher_factory is None:
            return None
        own_process = self._engine_args[2].own_process  # a vLLM teacher: a process of its own
        with ignored_in_children(), child_environment(self._environment(own_process=own_process)):
            return self._teacher_factory()

    def _build_agent(self, model: ModelConfig, tokenizer):
        """The multi-turn search agent of ``rollout.search_agent``, after checking that its retriever
        answers (a missing retriever fails here, before the engine starts, not at the first step)."""
        from megatron_empg.rollout.retriever.client import RetrieverClient
        from megatron_empg.rollout.search_agent import SearchAgent

        settings = self.config.rollout.search_agent
        client = RetrieverClient(settings.retriever_url, timeout_s=settings.timeout_s, retries=settings.retries)
        log.info("retriever at %s: %s", settings.retriever_url, client.health())
        max_model_len = self.config.rollout.max_model_len or model.max_position_embeddings
        return SearchAgent(settings, tokenizer, client, max_length=min(self.config.train.max_seq_len, max_model_len))

    @property
    def seeds_per_sample(self) -> int:
        """Seeds one sample draws from: the agent's turns per episode, else 1 (the same on every rank)."""
        agent = self.config.rollout.search_agent
        return agent.turns_per_episode if agent is not None else 1

    # ------------------------------------------------------------------ sampling

    def sample(self, step: int, examples: Sequence, *, dp_size: int) -> tuple[list[list[Sample]], dict]:
        """The samples of global prompt batch ``step`` (``examples``, every rank's copy) for each of
        the R replicas this rank's engine serves, ``[R][prompts per replica x n]`` in replica order
        (data-parallel rank ``first + r``), and the step's ``engines/*`` metrics (the same on every rank)."""
        placement = self.placement
        prompts = placement.prompts(len(examples))
        sampling = self.config.rollout.sampling
        if sampling.seed is not None:  # no seed stream repeats across steps or engines
            first = step * len(examples) + prompts.start
            sampling = dataclasses.replace(sampling, seed=sampling.seed + first * sampling.n * self.seeds_per_sample)
        payload, row, failure = None, None, "on other ranks"
        version = self.weights_version  # at the start: rollout.partial may load newer weights inside generate
        if self.engine is not None:
            start, tokens, teacher_s = time.perf_counter(), 0, 0.0
            try:
                self.engine.check_health()  # between calls: a core that no longer answers fails here, not in generate
                if self.teacher is not None:
                    self.teacher.check_health()
                prompt_ids = [examples[p].prompt_ids for p in prompts]
                payload = self.generate(prompt_ids, sampling, self.between_steps)
                tokens = sum(len(t.token_ids) for group in payload for t in group)
                if self.teacher is not None:  # the teacher's scores travel with the trajectories
                    scoring = time.perf_counter()
                    payload = list(zip(payload, self.teacher.score(prompt_ids, payload)))
                    teacher_s = time.perf_counter() - scoring
            except EngineFailure as error:
                log.error("engine %d failed inside the rollout of step %d: %s", placement.engine, step + 1, error)
                failure, payload = str(error), None
            seconds = time.perf_counter() - start - teacher_s
            row = [seconds, len(prompts) * sampling.n, tokens, float(payload is None), teacher_s]
        # each engine's seconds, samples, tokens, whether it failed and its teacher's seconds, on every
        # rank: all raise together
        table = placement.engine_table(row, 5)
        failed = [e for e in range(placement.num_engines) if table[e, 3] > 0]
        if failed:
            raise EngineLost(failed, failure)
        payload = placement.broadcast_from_owner(payload)
        if self._teacher_factory is None:
            payload = [(group, [None] * len(group)) for group in payload]
        per_replica = len(examples) // dp_size
        replicas = [
            [
                Sample.from_trajectory(examples[p], p, t, version=version, teacher=scores)
                for p in range(first, first + per_replica)
                for t, scores in zip(*payload[p - prompts.start])
            ]
            for first in range(prompts.start, prompts.stop, per_replica)
        ]
        return replicas, self._engine_metrics(table)

    def restart_engines(self, lost: EngineLost) -> None:
        """Start the engines of ``lost`` again (every rank calls it; the owners of those engines
        start theirs, from dummy weights: the caller pushes the weights they held), or re-raise
        ``lost`` past ``rollout.engine_restarts`` (counted over the run's attempts)."""
        self.restarts.spend(lost)
        if self.engine is not None and self.placement.engine in lost.engines:
            log.warning(
                "engine %d: starting it again (%d of rollout.engine_restarts=%d)",
                self.placement.engine,
                self.restarts.used,
                self.restarts.limit,
            )
            with contextlib.suppress(Exception):  # what is left of it: its processes are gone or killed
                self.engine.shutdown()
            self.engine = self._start(*self._engine_args)
            if self.teacher is not None:
                with contextlib.suppress(Exception):
                    self.teacher.shutdown()
                self.teacher = self._start_teacher()
            self.asleep = False

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, between_steps: Callable[[], None] | None = None
    ) -> list[list[Trajectory]]:
        """``[P][n]`` trajectories from this owner's engine: one response per sample, or the search
        agent's episodes (their masks exclude observations). ``between_steps``: the engine's
        (``rollout.partial``; never with the agent)."""
        if self.agent is None:
            extra = {} if between_steps is None else {"between_steps": between_steps}
            completions = self.engine.generate(prompts, sampling, **extra)
            return [[Trajectory.from_completion(c) for c in group] for group in completions]
        return [[e.trajectory() for e in group] for group in self.agent.rollout(self.engine, prompts, sampling)]

    def _engine_metrics(self, table: torch.Tensor) -> dict[str, float]:
        """Each engine's generate time, samples and tokens (``table`` [E, >= 3], an all-reduced
        table that only owners fill), as the spread over engines: ``engines/slowest`` is the slowest
        engine's index, ``engines/slowest_share`` its share of all engines' seconds (1/E when they
        are balanced; the others wait for it); with a teacher engine (column 4) the slowest
        teacher's scoring seconds, ``engines/teacher_seconds_max``."""
        placement = self.placement
        slowest = int(table[:, 0].argmax())
        total = float(table[:, 0].sum())
        return {
            "engines/count": float(placement.num_engines),
            "engines/seconds_max": float(table[slowest, 0]),
            "engines/seconds_mean": total / placement.num_engines,
            "engines/slowest": float(slowest),
            "engines/slowest_share": float(table[slowest, 0]) / total if total > 0 else 0.0,
            "engines/samples_min": float(table[:, 1].min()),
            "engines/samples_max": float(table[:, 1].max()),
            "engines/tokens_min": float(table[:, 2].min()),
            "engines/tokens_max": float(table[:, 2].max()),
            **({"engines/teacher_seconds_max": float(table[:, 4].max())} if self._teacher_factory else {}),
        }

    # ------------------------------------------------------------------ validation

    def validate(self, validation_sets: dict[str, list], score_rewards: RewardScorer, step: int) -> dict[str, float]:
        """``val/...`` metrics of the validation prompts under the engines' weights, the same on every
        rank: each engine samples and scores its share of every source (``placement.split``), in
        calls of ``validation.batch_size`` prompts; the sums are reduced once over the world."""
        settings = self.config.validation
        sampling = settings.sampling(self.config.rollout.sampling)
        start = time.perf_counter()
        sums: dict[str, dict[str, float]] = {}
        if self.engine is not None:
            for source, examples in validation_sets.items():
                sums[source] = {}
                share = self.placement.split(len(examples))
                for first in range(share.start, share.stop, settings.batch_size):
                    chunk = examples[first : min(first + settings.batch_size, share.stop)]
                    chunk_sampling = (
                        sampling
                        if sampling.seed is None
                        else dataclasses.replace(
                            sampling, seed=sampling.seed + first * sampling.n * self.seeds_per_sample
                        )
                    )
                    payload = self.generate([e.prompt_ids for e in chunk], chunk_sampling)
                    samples = [Sample.from_trajectory(e, i, t) for i, e in enumerate(chunk) for t in payload[i]]
                    add_sums(sums[source], sample_sums(samples, score_rewards(samples)))
        everyone: list = [sums]
        if _world_size() > 1:  # a few dicts per validation pass
            everyone = [None] * _world_size()
            dist.all_gather_object(everyone, sums)
        per_source: dict[str, dict[str, float]] = {source: {} for source in validation_sets}
        for rank_sums in everyone:
            for source, values in rank_sums.items():
                add_sums(per_source[source], values)
        metrics: dict[str, float] = {}
        totals: dict[str, float] = {}
        for source, values in per_source.items():
            metrics.update({f"val/{source}/{k}": v for k, v in sample_means(values).items()})
            add_sums(totals, values)
        metrics.update({f"val/{k}": v for k, v in sample_means(totals).items()})
        metrics["time/validation"] = time.perf_counter() - start
        log.info(
            "validation at step %d: reward/mean %.4g over %d samples",
            step,
            metrics["val/reward/mean"],
            totals["samples"],
        )
        return metrics

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """After the rollout, with ``rollout.sleep_while_training``: the engine frees its memory
        (``rollout.sleep_level``) until the sync wakes it."""
        if self.engine is None or not self.config.rollout.sleep_while_training:
            return
        self.engine.sleep(level=self.config.rollout.sleep_level)
        self.asleep = True

    def wake_weights(self) -> None:
        """Before a sync: the engine's weights come back first, so the new ones land before the KV
        cache takes its memory back."""
        if not self.asleep:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the trainer's allocator holds goes back to the engine
        self.engine.wake_up(["weights"])

    def wake_kv_cache(self) -> None:
        """After a sync: the KV cache; the engine is awake again."""
        if not self.asleep:
            return
        self.engine.wake_up(["kv_cache"])
        self.asleep = False

    def shutdown(self) -> None:
        if self.teacher is not None:
            self.teacher.shutdown()
            self.teacher = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def engine_environment(placement: EnginePlacement, engine_tp: int, *, shares_node: bool = False) -> dict[str, str]:
    """What an engine process needs to see of its node, set around its start by the owner:

    - GPU: ``CUDA_VISIBLE_DEVICES``, the owner's tensor-parallel GPUs (``LOCAL_RANK`` .. +
      ``engine_tp`` of the parent's visible list), so that the child lands on its replica's GPUs;
    - CPU: ``VLLM_CPU_OMP_THREADS_BIND``, this engine's share of the node's cores (``node_slot`` of
      ``node_slots``), one ``|``-separated list per engine TP rank, so that the engines on a node
      do not bind the same cores (vLLM's ``auto`` would). A value the user set is kept; ``nobind``
      when the node has fewer cores than engine ranks, or when training ranks the placement does
      not count share the node (``shares_node``: disaggregated engine ranks).
    """
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        mine = devices[placement.local_rank : placement.local_rank + engine_tp]
        if len(mine) < engine_tp:
            raise RuntimeError(
                f"engine {placement.engine} needs {engine_tp} GPUs from local rank {placement.local_rank}, but this "
                f"process sees {len(devices)} ({','.join(devices)})"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if shares_node or len(cores) < placement.node_slots * engine_tp:  # shared cores: let the OS schedule them
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    slot, slots = placement.node_slot, placement.node_slots
    share = cores[slot * len(cores) // slots : (slot + 1) * len(cores) // slots]
    per_rank = len(share) // engine_tp
    lists = [share[r * per_rank : (r + 1) * per_rank] for r in range(engine_tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, ids)) for ids in lists)}


@contextlib.contextmanager
def child_environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while an engine process starts (it inherits them), then the
    parent's environment as it was (the trainer's CUDA context exists already: it is unaffected)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _link_base_weights(init_from: str, model_dir: Path) -> None:
    """The base's safetensors (and index) in ``model_dir``, as links: an engine that serves LoRA
    adapters starts from them (``mcore.lora.base.base_path``: the base of a PEFT ``init_from`` too)."""
    from megatron_empg.mcore.lora.base import base_path

    for file in sorted(base_path(init_from).iterdir()):
        if file.name.endswith((".safetensors", ".safetensors.index.json")):
            link = model_dir / file.name
            link.unlink(missing_ok=True)
            link.symlink_to(file.resolve())
