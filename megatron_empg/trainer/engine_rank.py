"""What the engine ranks of a disaggregated job run (``rollout.placement: disaggregated``).

The engine ranks form their own world (``parallel.link``); engine e runs on
``rollout.tensor_parallel_size`` of them and its owner holds it (``parallel.placement``). They
draw every step's rollout (the rollout stage, rewards and dynamic sampling of
``trainer.collect``, as colocated ranks would), receive the weights that training rank 0
broadcasts after each step, probe them for the consistency gate and run the validation passes;
their lead (engine rank 0) sends what the training ranks need over the link. The message order
is in ``trainer.remote``.

A pre-emption signal does not stop an engine rank: it is recorded and reported with the next
message, and the engines stop when training rank 0 says so, after its checkpoint; their engine
processes are shut down before the rank exits.

    EngineRank(components, link, run_dir=...).serve()   # every engine rank, until told to stop
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch.distributed as dist

from megatron_empg.parallel.link import LEAD, TRAINER, Link
from megatron_empg.parallel.placement import engine_world_placement
from megatron_empg.trainer import machine
from megatron_empg.trainer.build import Components
from megatron_empg.trainer.collect import RolloutCollector, Scorer, StepRollout, prompt_batches, validation_sets
from megatron_empg.trainer.remote import Control, FromEngines, Start
from megatron_empg.trainer.rollout import RolloutStage
from megatron_empg.trainer.signals import stop_signals
from megatron_empg.trainer.start import load_tokenizer

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    """Training rank 0 said stop (its run ended or failed)."""


class EngineRank:
    """One engine rank: its part of an engine (the owner holds it), the data cursor, the reward and
    the validation sets; ``link`` on engine owners (None on the other ranks of an engine)."""

    def __init__(self, components: Components, link: Link | None, *, run_dir: str | Path | None = None) -> None:
        from megatron_empg.weight_sync.gate import probe_batch

        self.config = config = components.config
        layout = components.layout
        if dist.get_world_size() != layout.engine_ranks:
            raise ValueError(f"bound for {layout.engine_ranks} engine ranks, running on {dist.get_world_size()}")
        self.link = link
        self.is_lead = link is not None and link.rank == LEAD
        tokenizer = load_tokenizer(config)
        self.placement = engine_world_placement(layout.engines, config.rollout.tensor_parallel_size, layout.dp)
        machine.check_machine(config, components.model, engine_rank=self.placement.is_owner)  # shm_dir's room
        self.stage = RolloutStage(config, components.model, tokenizer, components.engine, self.placement,
                                  run_dir=Path(run_dir or config.logging.dir))  # fmt: skip
        engine = self.stage.engine
        self.transport = components.transport(engine, config.weight_sync) if engine is not None else None
        self.batches = prompt_batches(config, tokenizer)
        self.scorer = Scorer(config, tokenizer, components.reward)
        self.collector = RolloutCollector(config, self.stage, self.batches, self.scorer, dp_size=layout.dp)
        self.validation_sets = validation_sets(config, tokenizer)
        sync = config.weight_sync
        self.probe = probe_batch(sync.probe_num_sequences, sync.probe_length, components.model.vocab_size,
                                 sync.probe_seed)  # fmt: skip
        self.signal = 0

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        """Serve the training ranks from ``Start`` to the last step or a ``Control(stop)``."""
        with self._signals():
            try:
                self._serve()
            except EngineStopped:
                log.info("engine rank %d: stopped by training rank 0", dist.get_rank())

    def _serve(self) -> None:
        config = self.config
        start: Start = self._broadcast_from_trainer()
        self.batches.load_state_dict(start.data_state)
        step, steps = start.step, config.train.steps
        self.stage.weights_version = step
        self.receive_weights(step)
        if start.validate:
            self.validate(step)
        ahead = config.rollout.mode == "one_step_off"
        if ahead and not start.pending and step < steps:  # the pipeline's first rollout: the starting weights
            self.send(FromEngines(rollout=self.draw()))
        while step < steps:
            if not ahead:
                self.send(FromEngines(rollout=self.draw()))
            elif step + 1 < steps:  # step + 1's, while the trainers train `step`: sent as soon as drawn
                self.send(FromEngines(rollout=self.draw()))
            step += 1
            self.receive_weights(step)
            interval = config.validation.interval
            if interval and step % interval == 0:
                self.validate(step)
            self._broadcast_from_trainer()  # the step's Control: go on (a stop raises EngineStopped)

    def draw(self) -> StepRollout | None:
        """This step's rollout of every engine, gathered on the lead (None elsewhere)."""
        times: dict[str, float] = {}
        start = time.perf_counter()
        mine = self.collector.collect(times)
        seconds = time.perf_counter() - start
        parts = self._gather_on_lead(mine if self.placement.is_owner else None)
        if parts is None:
            return None
        owned = [p for p in parts if p is not None]  # engine order: owners are ascending ranks
        first = owned[0]
        metrics = {**first.metrics, "time/engine_rollout": seconds, "time/engine_rewards": times.get("rewards", 0.0)}
        return StepRollout(
            replicas=[r for p in owned for r in p.replicas], sums=[s for p in owned for s in p.sums],
            metrics=metrics, version=first.version, data_state=first.data_state,
        )  # fmt: skip

    def receive_weights(self, version: int) -> None:
        """One weight update from training rank 0 into this rank's engine, then the gate's probe."""
        from megatron_empg.weight_sync.gate import engine_probe
        from megatron_empg.weight_sync.transport import receive_weights

        message = self._broadcast_from_trainer()
        if message != ("weights",):
            raise RuntimeError(f"engine rank {dist.get_rank()}: expected a weight update, got {message!r}")
        if self.link is not None:  # an engine's owner: the buckets come over the link
            self.stage.wake_weights()
            receive_weights(self.link, self.transport)
            self.stage.wake_kv_cache()
        self.stage.weights_version = version
        sync = self.config.weight_sync
        if sync.gate_tolerance is None:
            return
        probe = None
        if self.stage.engine is not None:
            probe = engine_probe(self.stage.engine, self.probe, sync.probe_continuation, sync.probe_seed)
        probes = self._gather_on_lead(probe)
        self.send(FromEngines(probes=[p for p in probes or [] if p is not None]))  # every engine rank: a collective

    def validate(self, step: int) -> None:
        metrics = self.stage.validate(self.validation_sets, self.scorer, step)
        self.send(FromEngines(validation=metrics))

    # ------------------------------------------------------------------ messages

    def send(self, message: FromEngines) -> None:
        """``message`` from the lead to training rank 0, with the largest signal any engine rank got;
        every engine rank calls it (the signals are gathered), only the lead's message counts."""
        flags = self._gather_on_lead(self.signal)
        if flags is not None:
            self.link.send_object(dataclasses.replace(message, signal=max(flags)), dst=TRAINER)

    def _broadcast_from_trainer(self):
        """Training rank 0's next message on every engine rank (owners hear it on the link, then
        share it in the engine world); ``EngineStopped`` on a ``Control(stop)`` out of turn."""
        message = self.link.broadcast_object(src=TRAINER) if self.link is not None else None
        if dist.get_world_size() > 1:  # the lead's copy to every engine rank
            box = [message if self.is_lead else None]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
        if isinstance(message, Control) and message.stop:
            raise EngineStopped
        return message

    def _gather_on_lead(self, value) -> list | None:
        """Every engine rank's ``value`` in rank order on the lead (engine rank 0), None elsewhere."""
        if dist.get_world_size() == 1:
            return [value]
        gathered = [None] * dist.get_world_size() if self.is_lead else None
        dist.gather_object(value, gathered, dst=0)
        return gathered

    def _signals(self):
        def handler(signum, frame):
            self.signal = max(self.signal, signum)

        return stop_signals(handler)

    def shutdown(self) -> None:
        self.stage.shutdown()
        if self.link is not None:
            self.link.shutdown()
