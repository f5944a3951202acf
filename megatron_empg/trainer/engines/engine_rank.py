"""What the engine ranks of a disaggregated job run (``rollout.placement: disaggregated``).

The engine ranks form their own world (``parallel.link``); engine e runs on
``rollout.tensor_parallel_size`` of them and its owner holds it (``parallel.placement``). They
draw every step's rollout (the rollout stage, rewards and dynamic sampling of
``trainer.engines.collect``, as colocated ranks would), receive the weights that training rank 0
broadcasts after each step, probe them for the consistency gate and run the validation passes;
their lead (engine rank 0) sends what the training ranks need over the link. The message order
is in ``trainer.engines.remote``.

With ``rollout.max_staleness`` k >= 1 the engines run ahead: each owner's thread
(``TrainerListener``) stages every weight update in host memory as it is pushed; the engines
draw step t as soon as they hold weights of step t - 1 - k or newer, and between rollouts load the
newest update they have (waiting only when the next rollout would be too stale). Every sample
carries the version that drew it. Validation requests and the stop are served between rollouts.

A pre-emption signal does not stop an engine rank: it is recorded and reported with the next
message, and the engines stop when training rank 0 says so, after its checkpoint; their engine
processes are shut down before the rank exits.

    EngineRank(components, link, run_dir=...).serve()   # every engine rank, until told to stop
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

import torch.distributed as dist

from megatron_empg.parallel.link import LEAD, TRAINER, Link
from megatron_empg.parallel.placement import engine_world_placement
from megatron_empg.trainer.batching.batch import version_step
from megatron_empg.trainer.bind import machine
from megatron_empg.trainer.bind.build import Components
from megatron_empg.trainer.engines.collect import RolloutCollector, Scorer, StepRollout, prompt_batches, validation_sets
from megatron_empg.trainer.engines.remote import Control, FromEngines, Start
from megatron_empg.trainer.engines.rollout import RolloutStage
from megatron_empg.trainer.run import watchdog
from megatron_empg.trainer.run.signals import stop_signals
from megatron_empg.trainer.run.start import load_tokenizer
from megatron_empg.weight_sync.staging import WeightStage, load_staged

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
        self.stage = RolloutStage(
            config,
            components.model,
            tokenizer,
            components.engine,
            self.placement,
            run_dir=Path(run_dir or config.logging.dir),
        )
        engine = self.stage.engine
        self.transport = components.transport(engine, config.weight_sync) if engine is not None else None
        self.batches = prompt_batches(config, tokenizer)
        self.scorer = Scorer(config, tokenizer, components.reward)
        self.collector = RolloutCollector(config, self.stage, self.batches, self.scorer, dp_size=layout.dp)
        self.validation_sets = validation_sets(config, tokenizer)
        sync = config.weight_sync
        self.probe = probe_batch(
            sync.probe_num_sequences, sync.probe_length, components.model.vocab_size, sync.probe_seed
        )
        self.signal = 0
        self.listener: TrainerListener | None = None  # rollout.max_staleness >= 1: on engine owners
        self.loaded_in_flight = False  # rollout.partial: an update was loaded inside the last draw

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        """Serve the training ranks from ``Start`` to the last step or a ``Control(stop)``."""
        with self._signals():
            try:
                self._serve()
            except EngineStopped:
                log.info("engine rank %d: stopped by training rank 0", dist.get_rank())
                if self.config.rollout.max_staleness > 0:
                    self.send(FromEngines(stopped=True))  # training rank 0's inbox ends with it

    def _serve(self) -> None:
        start: Start = self._broadcast_from_trainer()
        self.batches.load_state_dict(start.data_state)
        if self.config.rollout.max_staleness > 0:
            self._serve_ahead(start)
        else:
            self._serve_in_step(start)

    def _serve_in_step(self, start: Start) -> None:
        """``rollout.max_staleness`` 0: one rollout per step, drawn with the weights it starts from."""
        config = self.config
        step, steps = start.step, config.train.steps
        self.stage.weights_version = step
        self.receive_weights(step)
        if start.validate:
            self.validate(step)
        while step < steps:
            self.send(FromEngines(rollout=self.draw()))
            step += 1
            self.receive_weights(step)
            interval = config.validation.interval
            if interval and step % interval == 0:
                self.validate(step)
            self._broadcast_from_trainer()  # the step's Control: go on (a stop raises EngineStopped)

    def _serve_ahead(self, start: Start) -> None:
        """``rollout.max_staleness`` k >= 1: step t's rollout with weights of step t - 1 - k or
        newer (the newest staged update loaded before each rollout), sent as soon as it is drawn;
        requests served between rollouts."""
        k, steps = self.config.rollout.max_staleness, self.config.train.steps
        self.listener = TrainerListener(self.link) if self.link is not None else None
        if self.config.rollout.partial and self.listener is not None:
            self.stage.between_steps = self._load_between_decode_steps
        self.stage.weights_version = -1  # none loaded yet
        self._load_newest(need=start.step)  # the starting weights
        step = start.step + start.pending  # rollouts of steps 1 .. step are on the training ranks
        while True:
            self._serve_requests()
            if step >= steps:  # every rollout drawn: load what is pushed, serve requests, until the stop
                self._load_newest(need=self._agree(self.stage.weights_version + 1 if self.is_lead else None))
                continue
            self._load_newest(need=step - k)  # step + 1 is drawn by weights of step - k or newer
            self.send(FromEngines(rollout=self.draw()))
            step += 1
            if self.config.rollout.partial:  # updates loaded inside the draw: their probes follow its rollout
                self._probe_if(self.loaded_in_flight)
                self.loaded_in_flight = False

    def _load_newest(self, need: int) -> None:
        """Wait until the engines hold weights of step ``need`` or newer (serving requests while
        they wait); load each engine's newest staged update, then send the probes of what the
        engines now hold (only if an engine loaded). Every engine rank calls it with the same
        ``need``."""
        while not self._agree(self._wait_staged(need) if self.is_lead else None):
            self._serve_requests()
        loaded = False
        if self.listener is not None:
            listener, stage = self.listener, self.listener.stage
            stage.wait(lambda: stage.newest >= need or self.stage.weights_version >= need or listener.failed)
            loaded = self._load_staged()
        self._probe_if(loaded)

    def _load_staged(self) -> bool:
        """This owner's newest staged update into its engine, if one came since its last load (no
        collective); whether it loaded one."""
        self.listener.raise_failure()
        update = self.listener.stage.take()
        if update is None:
            return False
        with watchdog.phase("load", version_step(update.version)):
            self.stage.wake_weights()
            load_staged(update, self.transport)
            self.stage.wake_kv_cache()
        self.stage.weights_version = version_step(update.version)
        return True

    def _probe_if(self, loaded: bool) -> None:
        """Probe what the engines hold if any engine ``loaded`` (every engine rank calls it)."""
        if self._agree_any(loaded):
            self._probe(ahead=True)

    def _load_between_decode_steps(self) -> None:
        """``rollout.partial``, inside a draw (this engine alone: no collective): the newest staged
        update, if one came since the last load; its probes follow the rollout (``_serve_ahead``).
        One update per draw: the gate can probe only the weights the engine holds after the draw,
        so a second push landing in the same draw waits for the load after it (and its own probe);
        a sample's staleness is its first token's, which this does not change."""
        if not self.loaded_in_flight and self._load_staged():
            self.loaded_in_flight = True

    def _wait_staged(self, need: int) -> bool:
        """The lead: True once its engine holds, or its stage has, weights of step ``need`` or
        newer; False if a request from training rank 0 came first."""
        stage, held = self.listener.stage, self.stage.weights_version
        stage.wait(lambda: max(stage.newest, held) >= need or self.listener.pending())
        return max(stage.newest, held) >= need

    def _serve_requests(self) -> None:
        """The requests training rank 0 sent so far (the lead's view, shared by every engine rank):
        validations, with the newest weights loaded first; a stop raises ``EngineStopped``."""
        requests = self._agree(self.listener.drain() if self.is_lead else None)
        for request in requests:
            if self.listener is not None and not self.is_lead:
                self.listener.next()  # the same request, from this owner's own listener
            if isinstance(request, Control):
                raise EngineStopped
            self._load_newest(need=request.step)
            self.validate(request.step)

    def _agree_any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any engine rank (every rank calls it)."""
        flags = self._gather_on_lead(flag)
        return self._agree(any(flags) if self.is_lead else None)

    def _agree(self, value):
        """The lead's ``value`` on every engine rank."""
        if dist.get_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def draw(self) -> StepRollout | None:
        """This step's rollout of every engine, gathered on the lead (None elsewhere)."""
        times: dict[str, float] = {}
        with watchdog.phase("draw", self.batches.cursor + 1):
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
            replicas=[r for p in owned for r in p.replicas],
            sums=[s for p in owned for s in p.sums],
            metrics=metrics,
            version=first.version,
            data_state=first.data_state,
        )

    def receive_weights(self, version: int) -> None:
        """One weight update from training rank 0 into this rank's engine, then the gate's probe."""
        from megatron_empg.weight_sync.transport import receive_weights

        message = self._broadcast_from_trainer()
        if message != ("weights",):
            raise RuntimeError(f"engine rank {dist.get_rank()}: expected a weight update, got {message!r}")
        if self.link is not None:  # an engine's owner: the buckets come over the link
            with watchdog.phase("load", version):
                self.stage.wake_weights()
                receive_weights(self.link, self.transport)
                self.stage.wake_kv_cache()
        self.stage.weights_version = version
        self._probe(ahead=False)

    def _probe(self, *, ahead: bool) -> None:
        """The gate's probe of the weights each engine holds, gathered on the lead and sent (every
        engine rank). Ahead, always sent (the training ranks' marker of a load), with each engine's
        weights (``versions``) and ``engine_self_check``."""
        from megatron_empg.weight_sync.gate import engine_probe, engine_self_check

        sync = self.config.weight_sync
        gate = sync.gate_tolerance is not None
        if not (gate or ahead):
            return
        mine = None
        if self.stage.engine is not None:
            probe = (
                engine_probe(self.stage.engine, self.probe, sync.probe_continuation, sync.probe_seed) if gate else None
            )
            check = engine_self_check(self.stage.engine, *probe, sync.probe_length) if gate and ahead else 0.0
            mine = (probe, check, self.stage.weights_version)
        owned = [p for p in self._gather_on_lead(mine) or [] if p is not None]  # engine order
        probes = [p for p, _, _ in owned] if gate else None
        if ahead:
            self.send(
                FromEngines(probes=probes, versions=[v for _, _, v in owned], self_check=[c for _, c, _ in owned])
            )
        else:
            self.send(FromEngines(probes=probes))

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


class TrainerListener:
    """An engine owner's thread (``rollout.max_staleness`` >= 1): every message of training rank 0
    as it comes: a weight update into ``stage`` (host memory, ``weight_sync.staging``), a
    ``Validate`` request or the stop queued for the engine's thread (go-on controls dropped)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.stage = WeightStage(version_step)
        self.requests: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._listen, name="empg-trainer-listener", daemon=True)
        self.thread.start()

    @property
    def failed(self) -> bool:
        """The link broke (the error waits in ``requests``)."""
        return self.error is not None

    def raise_failure(self) -> None:
        if self.error is not None:
            raise RuntimeError("the link to training rank 0 broke") from self.error

    def _listen(self) -> None:
        from megatron_empg.weight_sync.transport import receive_weights

        try:
            while True:
                message = self.link.broadcast_object(src=TRAINER)
                if message == ("weights",):
                    receive_weights(self.link, self.stage)
                    continue
                if isinstance(message, Control) and not message.stop:
                    continue
                self._queue(message)
                if isinstance(message, Control):
                    return
        except BaseException as error:  # noqa: BLE001  (the engine's thread raises it)
            self.error = error
            self._queue(error)

    def _queue(self, item) -> None:
        self.requests.put(item)
        self.stage.notify()

    def pending(self) -> bool:
        return not self.requests.empty()

    def drain(self) -> list:
        """The requests queued so far (none: empty)."""
        items = []
        while not self.requests.empty():
            items.append(self.next())
        return items

    def next(self):
        """The next request (waits for it); what ended the thread, raised."""
        item = self.requests.get()
        if isinstance(item, BaseException):
            raise RuntimeError("the link to training rank 0 broke") from item
        return item
