"""The rollout engines as the training loop sees them: one protocol, two placements.

``ColocatedEngines`` live on the training ranks (``rollout.placement: colocated``): they draw a
step's rollout when it starts, sleep while it trains (``rollout.sleep_while_training``) and wake
for the weight push. ``DisaggregatedEngines`` run on engine ranks of their own
(``trainer.engines.engine_rank``), behind the link on training rank 0 (``trainer.engines.remote``): the training
ranks receive their rollouts and probes; with ``rollout.max_staleness`` k >= 1 the engines run
ahead up to k weight versions, and the rollouts they drew for later steps wait on the training
ranks (a checkpoint keeps them).

Every training rank calls, in this order::

    engines.start(step, validate=...)        # where the run starts
    engines.push(shards, groups, step)       # the weights of `step` training steps done ...
    engines.gate(step, score, diagnose)      # ... and the consistency gate on them
    engines.validate(step)                   # val/... metrics (validation steps)
    per step:  engines.rollout(step, times, resync) -> update -> push -> gate -> [validate]
               -> [checkpoint: state_dict()] -> engines.end_of_step(stop)
    engines.close()

``Trainer`` holds one (``build_engines``) and asks nothing about where they are.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from megatron_empg.config import ModelConfig, RunConfig
from megatron_empg.parallel.link import Link
from megatron_empg.parallel.placement import EnginePlacement, build_placement
from megatron_empg.trainer.batching.batch import version_name
from megatron_empg.trainer.bind.build import Components
from megatron_empg.trainer.bind.layout import Layout
from megatron_empg.trainer.engines.collect import RolloutCollector, Scorer, StepRollout
from megatron_empg.trainer.engines.remote import FromEngines, RemoteEngines, Start
from megatron_empg.trainer.engines.rollout import EngineLost, RolloutStage
from megatron_empg.trainer.engines.teacher import TeacherEngine
from megatron_empg.trainer.run.start import write_hf_config
from megatron_empg.weight_sync.bridge import SyncGroups, SyncReport

Score = Callable[[list[list[int]]], Tensor]  # the trainer's log-probs of probe sequences
Diagnose = Callable[[], dict[str, float]]  # per tensor family: the worst round-trip error


class Engines(Protocol):
    """What the training loop asks of its engines (module docstring: the order of the calls)."""

    def start(self, step: int, *, validate: bool) -> None:
        """The run starts after ``step`` training steps; ``validate``: the loop validates the
        starting weights."""

    def rollout(self, step: int, times: dict[str, float], resync: Callable[[], object]) -> StepRollout:
        """The rollout of the step after ``step`` training steps, scored (scoring time in
        ``times["rewards"]``, the wait for engines that run ahead in ``times["rollout_wait"]``).
        ``resync``: pushes the weights last pushed again (every rank), for engines started again."""

    def push(self, shards: Sequence, groups: SyncGroups, step: int) -> SyncReport:
        """The policy after ``step`` training steps into every engine (every rank: its shards)."""

    def gate(self, step: int, score: Score, diagnose: Diagnose) -> float:
        """The consistency gate on the weights just pushed: the largest |log-prob difference|;
        raises ``weight_sync.gate.ConsistencyError`` above ``weight_sync.gate_tolerance``."""

    def validate(self, step: int) -> dict[str, float]:
        """``val/...`` metrics under the engines' weights, the same on every rank."""

    @property
    def signal(self) -> int:
        """The largest stop signal the engines reported (0: none)."""

    def end_of_step(self, stop: bool) -> None:
        """After each step's checkpoint: go on, or (the last step, a signal) stop."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold of the engines to resume as the run would have gone on."""

    def load_state_dict(self, state: dict) -> None: ...

    def hf_assets(self) -> Path | None:
        """A HF config + tokenizer directory for the checkpoints' ``hf/`` (rank 0; None elsewhere)."""

    def close(self) -> None: ...


def training_placement(layout: Layout, groups, link: Link | None) -> EnginePlacement:
    """The engines as this training rank sees them (``parallel.placement``; every training rank
    calls it together): colocated, ``layout.engines`` of them on the training ranks;
    disaggregated, one engine behind training rank 0, the link's end (``link``: there only)."""
    remote = layout.engine_ranks > 0
    if remote and (dist.get_rank() == 0) != (link is not None):
        raise ValueError("disaggregated engines need the link on training rank 0, and only there")
    return build_placement(
        1 if remote else layout.engines,
        tp_rank=groups.tp_rank,
        pp_rank=groups.pp_rank,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        cp_rank=groups.cp_rank,
    )


def engine_on_this_rank(layout: Layout, placement: EnginePlacement) -> bool:
    """Whether this training rank's process holds an engine (the machine checks its room)."""
    return layout.engine_ranks == 0 and placement.is_owner


def build_engines(
    components: Components,
    placement: EnginePlacement,
    *,
    tokenizer,
    batches,
    scorer: Scorer,
    validation_sets: dict,
    probe: list[list[int]],
    dp_size: int,
    replica: int,
    run_dir: Path,
    link: Link | None,
) -> Engines:
    """The engines of ``components.layout`` for this training rank: the engines start here (before
    the policy is built: vLLM checks the free GPU memory it is given). ``batches``: the data
    cursor (disaggregated engines send theirs with each rollout and the training ranks' copy
    follows it, for the checkpoints)."""
    config = components.config
    if components.layout.engine_ranks > 0:
        return DisaggregatedEngines(
            config,
            components.model,
            link,
            batches,
            tokenizer=tokenizer,
            run_dir=run_dir,
            placement=placement,
            probe=probe,
        )
    distill, teacher = components.distill, None
    if distill is not None and distill.placement.on_engines:
        teacher = functools.partial(
            TeacherEngine, config, components.engine, distill.term.teacher_k, max_model_len=distill.context
        )
    stage = RolloutStage(
        config, components.model, tokenizer, components.engine, placement, run_dir=run_dir, teacher=teacher
    )
    collector = RolloutCollector(config, stage, batches, scorer, dp_size=dp_size, replica=replica)
    return ColocatedEngines(
        config,
        components.model,
        stage,
        collector,
        lambda engine: components.transport(engine, config.weight_sync),
        scorer=scorer,
        validation_sets=validation_sets,
        probe=probe,
    )


def _push(
    config: RunConfig, model: ModelConfig, shards, groups: SyncGroups, transport, step: int, placement: EnginePlacement
) -> SyncReport:
    from megatron_empg.weight_sync import bridge

    return bridge.sync_weights(
        shards,
        model,
        groups,
        transport,
        version_name(step),
        bucket_bytes=int(config.weight_sync.bucket_size_mb * 2**20),
        placement=placement,
    )


class ColocatedEngines:
    """Engines on the training ranks (``trainer.engines.rollout.RolloutStage``): a step's rollout is drawn
    when it starts (``trainer.engines.collect.RolloutCollector``), then they sleep until the push wakes
    them, their weights first, their KV cache after."""

    signal = 0  # the training ranks' own signals are the loop's

    def __init__(
        self,
        config: RunConfig,
        model: ModelConfig,
        stage: RolloutStage,
        collector: RolloutCollector,
        make_transport: Callable,
        *,
        scorer: Scorer,
        validation_sets: dict,
        probe: list[list[int]],
    ) -> None:
        self.config, self.model, self.stage, self.collector = config, model, stage, collector
        self.scorer, self.validation_sets, self.probe = scorer, validation_sets, probe
        self._make_transport = make_transport  # (engine) -> its weight transport: again for a restarted engine
        self.transport = make_transport(stage.engine) if stage.engine is not None else None

    def start(self, step: int, *, validate: bool) -> None:
        pass

    def rollout(self, step: int, times: dict[str, float], resync: Callable[[], object]) -> StepRollout:
        """An engine lost inside the rollout (``EngineLost``, on every rank) is started again, given
        the weights it held (``resync``), and the rollout drawn again from the same prompts with the
        same seeds: the step is the one it would have been (``rollout.engine_restarts``)."""
        cursor = self.collector.batches.state_dict()
        while True:
            try:
                rollout = self.collector.collect(times)
                break
            except EngineLost as lost:
                self.collector.batches.load_state_dict(cursor)
                self.stage.restart_engines(lost)  # past rollout.engine_restarts: raises (restartable)
                if self.stage.engine is not None:
                    self.transport = self._make_transport(self.stage.engine)
                resync()
        rollout.metrics["rollout/engine_restarts"] = float(self.stage.restarts.used)
        self.stage.sleep()
        return rollout

    def push(self, shards, groups: SyncGroups, step: int) -> SyncReport:
        self.stage.wake_weights()  # the new weights land before the KV cache takes its memory back
        report = _push(self.config, self.model, shards, groups, self.transport, step, self.stage.placement)
        self.stage.wake_kv_cache()
        self.stage.weights_version = step
        return report

    def gate(self, step: int, score: Score, diagnose: Diagnose) -> float:
        from megatron_empg.weight_sync.gate import verify_sync

        sync = self.config.weight_sync
        return verify_sync(
            self.stage.engine,
            self.probe,
            score,
            version_name(step),
            tolerance=sync.gate_tolerance,
            continuation=sync.probe_continuation,
            seed=sync.probe_seed,
            diagnose=diagnose,
            placement=self.stage.placement,
        )

    def validate(self, step: int) -> dict[str, float]:
        return self.stage.validate(self.validation_sets, self.scorer, step)

    def end_of_step(self, stop: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}  # a step's rollout is drawn inside the step: nothing is in flight between steps

    def load_state_dict(self, state: dict) -> None:
        pass

    def hf_assets(self) -> Path | None:
        return self.stage.model_dir if self.stage.engine is not None else None

    def close(self) -> None:
        self.stage.shutdown()


class DisaggregatedEngines:
    """Engines on ranks of their own, one engine behind training rank 0 to the training ranks
    (``trainer.engines.remote.RemoteEngines``: rank 0 holds the link and shares what it receives).

    ``rollout.max_staleness`` 0: each step's rollout is received when the step starts and the
    gate probes the weights as they are pushed. k >= 1: the engines run ahead; what they send is
    sorted as it arrives (``_take``): rollouts wait in ``ready`` for their step (the oldest first;
    ``time/rollout_wait``: how long a step waited for one), probes wait for the next gate, which
    checks them against the log-probs the training ranks computed when they pushed those weights
    (``weight_sync.gate.verify_staged_probes``). A checkpoint first waits until the engines have
    loaded the weights just pushed (every rollout drawn with older ones has then arrived) and keeps
    the rollouts in ``ready``; a resumed run trains them, and the engines draw on from there."""

    def __init__(
        self,
        config: RunConfig,
        model: ModelConfig,
        link: Link | None,
        batches,
        *,
        tokenizer,
        run_dir: Path,
        placement: EnginePlacement,
        probe: list[list[int]],
    ) -> None:
        from megatron_empg.weight_sync.transport import LinkTransport

        self.config, self.model, self.batches, self.tokenizer = config, model, batches, tokenizer
        self.run_dir, self.placement, self.probe = run_dir, placement, probe
        self.staleness = config.rollout.max_staleness
        self.remote = RemoteEngines(link, inbox=self.staleness > 0)
        self.transport = LinkTransport(link) if link is not None else None
        self.ready: collections.deque[StepRollout] = collections.deque()  # k >= 1: drawn, not trained yet
        self.pushed = -1  # the weights last pushed (training steps)
        self.loaded = -1  # the oldest weights an engine holds, as its last probes said
        self.trainer_logprobs: dict[int, Tensor] = {}  # k >= 1: per pushed version, until the engines probe it
        self.unchecked: list[FromEngines] = []  # k >= 1: probes not yet gated
        self.gate_value = 0.0

    def start(self, step: int, *, validate: bool) -> None:
        self.remote.start(
            Start(step, self.batches.state_dict(), pending=len(self.ready), validate=validate and self.staleness == 0)
        )
        self.remote.stopped = step >= self.config.train.steps  # no step left: the engines stop at once

    def rollout(self, step: int, times: dict[str, float], resync: Callable[[], object]) -> StepRollout:
        """(An engine rank that loses its engine exits restartable: ``resync`` is not needed.)"""
        if self.staleness == 0:
            return self._receive_rollout()
        start = time.perf_counter()
        while not self.ready:
            self._take(self.remote.receive())
        times["rollout_wait"] = time.perf_counter() - start
        rollout = self.ready.popleft()
        stale = max((step - s.version for replica in rollout.replicas for s in replica), default=0)
        if stale > self.staleness:
            raise RuntimeError(
                f"step {step}'s rollout was drawn {stale} steps back, beyond rollout.max_staleness={self.staleness}"
            )
        return rollout

    def _receive_rollout(self) -> StepRollout:
        """The engines' next rollout (all replicas), on every training rank; the data cursor
        follows theirs."""
        rollout = self.remote.rollout()
        self.batches.load_state_dict(rollout.data_state)
        return rollout

    def _take(self, message: FromEngines) -> FromEngines:
        """k >= 1: a message of the engines, sorted: a rollout into ``ready`` (the data cursor
        follows it), probes into ``unchecked``. Returns it."""
        if message.rollout is not None:
            self.ready.append(message.rollout)
            self.batches.load_state_dict(message.rollout.data_state)
        if message.versions is not None:
            self.loaded = min(message.versions)
            if self.config.weight_sync.gate_tolerance is not None:
                self.unchecked.append(message)
        return message

    def push(self, shards, groups: SyncGroups, step: int) -> SyncReport:
        report = _push(self.config, self.model, shards, groups, self.transport, step, self.placement)
        self.pushed = step
        return report

    def gate(self, step: int, score: Score, diagnose: Diagnose) -> float:
        from megatron_empg.weight_sync.gate import verify_probes

        tolerance = self.config.weight_sync.gate_tolerance
        if self.staleness == 0:
            return verify_probes(
                self.remote.probes(), score, version_name(step), tolerance=tolerance, diagnose=diagnose
            )
        self.trainer_logprobs[step] = score(self.probe).cpu()
        if self.loaded < 0:  # the run's first weights: the engines are idle, so wait for their probes
            self._wait_loaded(step)
        return self._check_probes(diagnose)

    def _wait_loaded(self, step: int) -> None:
        """k >= 1: receive until every engine said it holds weights of ``step`` or newer."""
        while self.loaded < step:
            self._take(self.remote.receive())

    def _check_probes(self, diagnose: Diagnose | None) -> float:
        """k >= 1: gate the probes received so far; the largest difference (the last one's if none came)."""
        from megatron_empg.weight_sync.gate import verify_staged_probes

        tolerance = self.config.weight_sync.gate_tolerance
        checked = []
        for message in self.unchecked:
            for engine, version in enumerate(message.versions):
                if version not in self.trainer_logprobs:
                    continue
                checked.append(
                    verify_staged_probes(
                        [message.probes[engine]],
                        [message.self_check[engine]],
                        self.trainer_logprobs[version],
                        version_name(version),
                        tolerance=tolerance,
                        diagnose=diagnose,
                        engines=[engine],  # one engine's probe at a time: named by its index in the run
                    )
                )
        self.unchecked.clear()
        for version in [v for v in self.trainer_logprobs if v < self.loaded]:  # never loaded, or gated
            del self.trainer_logprobs[version]
        if checked:
            self.gate_value = max(checked)
        return self.gate_value

    def validate(self, step: int) -> dict[str, float]:
        if self.staleness == 0:
            return self.remote.validation()
        self.remote.request_validation(step)
        while (message := self._take(self.remote.receive())).validation is None:
            pass
        return message.validation

    @property
    def signal(self) -> int:
        return self.remote.engine_signal or 0

    def end_of_step(self, stop: bool) -> None:
        self.remote.control(stop=stop)

    def state_dict(self) -> dict:
        """k >= 1: every rollout drawn with weights older than those just pushed, received first
        (restored on resume, not drawn again)."""
        if self.staleness == 0:
            return {}
        self._wait_loaded(self.pushed)
        self._check_probes(None)
        return {"rollouts": list(self.ready)}

    def load_state_dict(self, state: dict) -> None:
        self.ready = collections.deque(state.get("rollouts", []))

    def hf_assets(self) -> Path | None:
        """Written once into the run directory (the engines' own are on other ranks)."""
        if dist.get_rank() != 0:
            return None
        directory = self.run_dir / "hf_assets"
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            write_hf_config(self.model, directory)
            self.tokenizer.save_pretrained(directory)
        return directory

    def close(self) -> None:
        self.remote.close()
