"""The RL loop: one ``Trainer.step`` is

    rollout -> rewards -> advantages -> micro-batches -> old pass -> anchor pass [-> teacher pass]
    -> update (per mini-batch) -> EMA update -> weight sync (+ consistency gate) -> metrics
    -> checkpoint

each stage a short method. SPMD: every rank runs the same loop. The engines are one object
(``trainer.engines.placements``) wherever they run: colocated on the training ranks (by default
one per data-parallel replica, on its first rank; each samples its replicas' prompts and is
synced from its own replica, and sleeps while the step trains) or disaggregated on ranks of their
own (their rollouts arrive over the link; with ``rollout.max_staleness`` k >= 1 they run up to k
weight versions ahead, drawing later steps while this one trains). The loop asks them for a
step's rollout, pushes the weights into them and gates the push, and checkpoints what they hold
between steps. The micro-batches (``trainer.batching.batch``) are packed rows by default,
balanced between the replicas that share an engine (each holds all their samples). A step uses
the data cursor's next global prompt batch (with ``algorithm.dynamic_sampling``, as many as it
takes to fill the batch with informative groups); the cursor is checkpointed, so a resumed run
continues with the same prompts. The policy and its anchor are built by ``trainer.policy``.

A ``Trainer`` is built from what ``trainer.bind.build.bind`` resolved (``Components``): it
branches on no configured name, and on no placement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_empg.config import ConfigError
from megatron_empg.core.microbatch import MicroBatch, StatsResult
from megatron_empg.parallel.link import Link
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.batching.forward_batch import forward_rows
from megatron_empg.trainer.batching.stage import BatchStage
from megatron_empg.trainer.bind import machine
from megatron_empg.trainer.bind.build import Components
from megatron_empg.trainer.engines.collect import Scorer, prompt_batches, validation_sets
from megatron_empg.trainer.engines.metrics import rollout_metrics, step_metrics, timed
from megatron_empg.trainer.engines.placements import build_engines, engine_on_this_rank, training_placement
from megatron_empg.trainer.policy import build_anchor, build_policy
from megatron_empg.trainer.run import watchdog
from megatron_empg.trainer.run.bad_steps import BadSteps
from megatron_empg.trainer.run.checkpoints import Checkpoints, TrainerCheckpoints, async_saves
from megatron_empg.trainer.run.device_memory import peak_memory, peak_metrics
from megatron_empg.trainer.run.run_dir import check_fresh_start
from megatron_empg.trainer.run.signals import any_rank_signalled, ignored_in_children, stop_signals
from megatron_empg.trainer.run.start import load_tokenizer
from megatron_empg.trainer.teacher import build_teacher

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepOutput:
    step: int
    metrics: dict[str, float]


class Trainer(TrainerCheckpoints):
    """Everything one run holds. Build with ``Trainer(bind(config, world_size))`` on every training
    rank (after ``torch.distributed`` is initialised: ``parallel.link.start_worlds``), then
    ``run(resume=...)``. With disaggregated engines, ``link`` on training rank 0 (the engine ranks
    run ``trainer.engines.engine_rank``)."""

    def __init__(self, components: Components, *, run_dir: str | Path | None = None, link: Link | None = None) -> None:
        from megatron_empg.mcore import parallel_state
        from megatron_empg.mcore.checkpoint.writer import start_checkpoint_writer

        self.components = components
        self.config = config = components.config
        self.model = components.model
        self.run_dir = Path(run_dir or config.logging.dir)
        layout = components.layout
        if dist.get_world_size() != layout.training_ranks:
            raise ValueError(f"bound for {layout.training_ranks} training ranks, running on {dist.get_world_size()}")
        self.tokenizer = load_tokenizer(config)
        self.groups = groups = parallel_state.initialize_model_parallel(config.parallel, config.train.seed)
        self.placement = training_placement(layout, groups, link)
        self.batching = BatchStage(config, self.model, self.placement, groups, pad_id=self.tokenizer.pad_token_id or 0)
        self._check_machine(engine_here=engine_on_this_rank(layout, self.placement))
        self._build_data()
        self.engines = build_engines(
            components,
            self.placement,
            tokenizer=self.tokenizer,
            batches=self.batches,
            scorer=self.scorer,
            validation_sets=self.validation_sets,
            probe=self._probe_batch(),
            dp_size=groups.dp_size,
            replica=self.batching.replica,
            run_dir=self.run_dir,
            link=link,
        )
        # Megatron's checkpoint writer (a spawned process): a pre-emption signal to the process group must
        # not kill it
        with ignored_in_children():
            start_checkpoint_writer()
        parallel_state.seed_everything(config.train.seed, groups.pp_rank)  # again: an in-process vLLM seeds globally
        policy = build_policy(components, groups)
        self.models, self.optimizer, self.scheduler = policy.models, policy.optimizer, policy.scheduler
        self.anchor = build_anchor(components, policy)
        self.teacher = build_teacher(components, groups)
        from megatron_empg.mcore.lora.sync import LORA_SYNC_MODES

        self.synced_weights = LORA_SYNC_MODES[config.weight_sync.lora_mode]()  # what sync_weights pushes
        self.lora_base = None  # a LoRA policy's base as its checkpoints record it (mcore.lora.base)
        if self.model.lora is not None:
            from megatron_empg.mcore.lora.base import base_path, base_record

            self.lora_base = base_record(base_path(config.checkpoint.init_from))
        self.step_index = 0
        self.optimizer_steps = 0  # applied ones (a refused step counts for nothing, the anchor's schedule included)
        self.bad_steps = BadSteps(config.train)
        self._stop_signal: int | None = None
        self._peaks: dict[str, int] = {}  # this step's device memory peak per phase
        self.checkpoints = Checkpoints(self._start_save, background=async_saves(config.checkpoint.async_save))

    # ------------------------------------------------------------------ setup

    def _check_machine(self, *, engine_here: bool) -> None:
        """What only the machine can tell, before the engines start: room in ``weight_sync.shm_dir``
        for a bucket file (on each engine's owner: ``engine_here``), a GPU with Transformer Engine
        for a TE FP8 anchor, the memory plan against this GPU. A ``ConfigError`` on every rank
        together (the lowest rank's, if several)."""
        problem = None
        try:
            machine.check_machine(self.config, self.model, engine_rank=engine_here)
            machine.check_memory_here(self.components)
        except ConfigError as error:
            problem = (error.field, error.reason)
        problems = [problem]
        if dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        found = next((p for p in problems if p is not None), None)
        if found is not None:
            raise ConfigError(*found)

    def _build_data(self) -> None:
        """The data cursor (global batches; with disaggregated engines a copy of the engines', kept
        for the checkpoints), the scorer and the validation sets (every rank: a bad file stops all)."""
        self.batches = prompt_batches(self.config, self.tokenizer)
        self.scorer = Scorer(self.config, self.tokenizer, self.components.reward)
        self.validation_sets = validation_sets(self.config, self.tokenizer)

    def _probe_batch(self) -> list[list[int]]:
        from megatron_empg.weight_sync.gate import probe_batch

        sync = self.config.weight_sync
        return probe_batch(sync.probe_num_sequences, sync.probe_length, self.model.vocab_size, sync.probe_seed)

    # ------------------------------------------------------------------ the loop

    def run(self, *, resume: bool = False, logger=None) -> list[StepOutput]:
        """Train until ``train.steps``; on SIGTERM/SIGUSR1 checkpoint after the current step and return.
        The steps' metrics, with the validation passes' (``val/...``) after steps that are multiples
        of ``validation.interval``, and with ``validation.at_start`` before the first step unless the
        run resumes (a record of the step it starts from: 0, or ``continue_from``'s)."""
        if not resume:
            check_fresh_start(self.config)
        resumed = resume and self.resume()
        if not resumed and self.config.checkpoint.continue_from is not None:
            self.continue_from(self.config.checkpoint.continue_from)
        outputs = []
        validation = self.config.validation
        steps = self.config.train.steps
        with self._signals():
            with watchdog.phase("start", self.step_index):
                self.engines.start(self.step_index, validate=validation.at_start and not resumed)
                self.sync_weights()  # the engine starts from dummy weights (or those of before the resume)
            if validation.at_start and not resumed:  # the weights this run starts from
                outputs.append(StepOutput(self.step_index, self.validate()))
                if logger is not None:
                    logger.log(self.step_index, outputs[-1].metrics)
            stop = None
            while self.step_index < steps and stop is None:
                # the whole step watched: its time outside the named phases too (the stop vote is a collective)
                with watchdog.phase("step", self.step_index + 1):
                    stop = self._step_and_after(outputs, logger)
        return outputs

    def _step_and_after(self, outputs: list[StepOutput], logger) -> int | None:
        """One step, its validation, its log record and checkpoint; the stop signal agreed on, or None."""
        validation, steps = self.config.validation, self.config.train.steps
        out = self.step()
        if validation.interval and self.step_index % validation.interval == 0:
            out.metrics.update(self.validate())
        out.metrics.update(self.checkpoints.metrics())
        outputs.append(out)
        if logger is not None:
            logger.log(out.step, out.metrics)
        watchdog.step_done(out.step)
        interval = self.config.checkpoint.interval
        last = self.step_index == steps
        # A local decision (the handler may set _stop_signal again at any time): every rank
        # stops after the same step; the engine ranks' signals come with their messages.
        signalled = max(self._stop_signal or 0, self.engines.signal)
        stop = any_rank_signalled(signalled or None, dist.group.WORLD)
        if self.checkpoints.written():  # a background save every rank has written: committed
            with watchdog.phase("checkpoint", self.step_index):  # (only then: the phase learns real saves)
                self.checkpoints.finish()
        if last or (interval and self.step_index % interval == 0) or stop is not None:
            self.save(blocking=last or stop is not None)
        self.engines.end_of_step(stop=stop is not None or last)
        if stop is not None:
            log.warning("signal %d: checkpointed at step %d, stopping", stop, self.step_index)
        return stop

    def step(self) -> StepOutput:
        times: dict[str, float] = {}
        self._peaks = {}
        with self._phase(times, "rollout"):
            rollout = self.engines.rollout(self.step_index, times, resync=self.sync_weights)
        # scored (between generation batches) or waited for (engines running ahead) inside it
        times["rollout"] -= times.get("rewards", 0.0) + times.get("rollout_wait", 0.0)
        samples = rollout.replicas[self.batching.replica]
        with self._phase(times, "advantages"):
            advantages = self.advantages(samples)
        with self._phase(times, "batching"):
            batch = self.batching.build(rollout.replicas, advantages, device=next(self.models[0].parameters()).device)
        micro = [mb for mini in batch.minis for mb in mini]
        with self._phase(times, "old_pass"):
            self.old_pass(micro)
            algorithm = self.config.algorithm
            behavior = batch.behavior_is(algorithm.behavior_is, algorithm.behavior_is_cap)  # vs the sampler
        with self._phase(times, "anchor_pass"):
            self.anchor_pass(micro)
        if self.teacher is not None:
            with self._phase(times, "teacher_pass"):
                self.teacher.stats(micro, self._forward_stats)  # trainer.teacher: per placement
        with self._phase(times, "update"):
            done = self.optimizer_steps
            update_metrics = self.update(batch.minis)
        if self.bad_steps.exhausted:  # train.max_consecutive_skips: the same step on every rank
            raise self.bad_steps.stop(self.step_index + 1, samples, advantages, self.run_dir, self.groups)
        with self._phase(times, "ema_update"):
            ema_updates = self.ema_update(done)
        self.step_index += 1
        with self._phase(times, "weight_sync"):
            sync_metrics = self.sync_weights()
        metrics = step_metrics(
            rollout,
            samples,
            batch,
            replica=self.batching.replica,
            groups=self.groups,
            dynamic_sampling=self.config.algorithm.dynamic_sampling is not None,
            update=update_metrics,
            sync=sync_metrics,
            times=times,
            behavior=behavior,
        )
        metrics["anchor/updates"] = float(ema_updates)
        metrics.update(rollout_metrics(rollout, self.step_index - 1), **peak_metrics(self._peaks))
        return StepOutput(self.step_index, metrics)

    @contextlib.contextmanager
    def _phase(self, times: dict[str, float], name: str):
        """A phase of the step in flight: timed into ``times[name]``, its device memory peak kept
        (``trainer.run.device_memory``) and watched (``trainer.run.watchdog``)."""
        with watchdog.phase(name, self.step_index + 1), timed(times, name), peak_memory(self._peaks, name):
            yield

    # ------------------------------------------------------------------ stages

    def validate(self) -> dict[str, float]:
        """``val/...`` metrics of the validation prompts under the engines' weights, the same on
        every rank (``RolloutStage.validate``: the engines split the prompts)."""
        with watchdog.phase("validation", self.step_index):
            return self.engines.validate(self.step_index)

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        """[B] per-sample advantages (groups are this replica's prompts: whole groups never split)."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        return self.components.advantage(rewards, groups)

    def old_pass(self, micro: list[MicroBatch]) -> None:
        """log pi_old at the targets (and the policy's top-k for a reverse Top-k KL) into ``micro``;
        they are the anchor's too when it is the behaviour policy (``StatsPlan.anchor_is_old``)."""
        from megatron_empg.mcore.step import StatsRequest

        plan = self.components.stats
        top1 = self.teacher is not None  # distillation's top-1 agreement
        request = StatsRequest(
            vocab_size=self.model.vocab_size,
            k=max(plan.old_topk, int(top1)),
            with_entropy=False,
            chunk_size=self.config.algorithm.loss.chunk_size,
        )
        for mb, out in zip(micro, self._forward_stats(self.models, micro, request)):
            mb.old_logprobs = out.logprobs
            if plan.old_topk:
                mb.topk_ids = out.topk_ids
            if top1:
                mb.student_top1 = out.topk_ids[..., 0]
            if plan.anchor_is_old:
                mb.anchor_logprobs = out.logprobs
                if plan.old_topk:
                    mb.topk_anchor_logprobs = out.topk_logprobs

    def anchor_pass(self, micro: list[MicroBatch]) -> None:
        """log pi_ref at the targets and at the Top-k ids (forward KL: the anchor's own top-k)."""
        from megatron_empg.mcore.step import StatsRequest

        plan = self.components.stats
        if not plan.anchor:
            return
        request = StatsRequest(
            vocab_size=self.model.vocab_size,
            k=plan.anchor_topk,
            with_entropy=False,
            extra_ids_key="topk_ids" if plan.anchor_at_old_topk else None,
            chunk_size=self.config.algorithm.loss.chunk_size,
        )
        with self.anchor.forward_models() as models:
            outs = self._forward_stats(models, micro, request)
        for mb, out in zip(micro, outs):
            mb.anchor_logprobs = out.logprobs
            if plan.anchor_at_old_topk:
                mb.topk_anchor_logprobs = out.extra_logprobs
            elif plan.anchor_topk:
                mb.topk_ids, mb.topk_anchor_logprobs = out.topk_ids, out.topk_logprobs

    def _forward_stats(self, models, micro: list[MicroBatch], request) -> list[StatsResult]:
        """``request``'s per-token statistics of ``models`` for each of ``micro``, on every
        pipeline stage, computed on the forward rows (``train.max_tokens_per_forward_microbatch``)."""
        from megatron_empg.mcore.step import forward_stats, share_stats

        rows = forward_rows(micro, self.batching.forward_plan)
        outputs = forward_stats(models, rows.batches, request, self.groups)
        return rows.split_stats(share_stats(outputs, rows.batches, request, self.groups))

    def update(self, minis: list[list[MicroBatch]]) -> dict[str, float]:
        """One optimizer step per mini-batch (of micro-batches), unless refused (``trainer.run.bad_steps``);
        the mean of their metrics, and ``train/skipped_steps``: how many were refused."""
        from megatron_empg.mcore.step import train_step
        from megatron_empg.parallel.rl_loss import loss_units

        units = functools.partial(loss_units, agg_mode=self.config.algorithm.loss.agg_mode)
        results = []
        for micro in minis:
            results.append(
                train_step(
                    self.models,
                    self.optimizer,
                    self.scheduler,
                    micro,
                    self.components.loss_fn,
                    groups=self.groups,
                    fused_output=self.config.train.fused_output_loss,
                    guard=self.bad_steps.guard,
                    loss_units=units,
                )
            )
            self.optimizer_steps += results[-1].skipped is None
        # a mixture of experts' routing metrics keep their own moe/ names (mcore.moe.routing), distillation its distill/
        merged = {
            k if k.startswith(("moe/", "distill/")) else f"actor/{k}": statistics.fmean(r.metrics[k] for r in results)
            for k in results[0].metrics
        }
        merged["actor/grad_norm"] = statistics.fmean(r.grad_norm for r in results)
        merged["actor/lr"] = results[-1].lr
        merged["train/skipped_steps"] = float(self.bad_steps.record(self.step_index + 1, [r.skipped for r in results]))
        return merged

    def ema_update(self, done: int) -> int:
        """Anchor EMA updates due after this step's applied optimizer steps, ``done + 1`` .. (0
        without an anchor)."""
        if self.anchor is None:
            return 0
        return sum(self.anchor.maybe_update(s) for s in range(done + 1, self.optimizer_steps + 1))

    def sync_weights(self) -> dict[str, float]:
        """Push the policy into the engine, then the consistency gate (raises on a mismatch)."""
        from megatron_empg.mcore.step import score_sequences
        from megatron_empg.weight_sync import bridge

        groups = bridge.SyncGroups(
            self.groups.tp_group,
            self.groups.pp_group,
            self.placement.feeds_engine,
            ep_group=self.groups.ep_group,
            etp_group=self.groups.etp_group,
        )
        shards = self.synced_weights.shards(self.models)
        report = self.engines.push(shards, groups, self.step_index)
        metrics = {"sync/seconds": report.seconds, "sync/gbytes": report.num_bytes / 1e9}
        if self.config.weight_sync.gate_tolerance is not None:
            for model in self.models:
                model.eval()
            score = lambda seqs: score_sequences(self.models, seqs, self.model.vocab_size, self.groups)  # noqa: E731
            bucket = int(self.config.weight_sync.bucket_size_mb * 2**20)  # the diagnosis buckets as the sync did
            diagnose = lambda: bridge.round_trip_errors(shards, self.model, groups, bucket_bytes=bucket)  # noqa: E731
            metrics["sync/gate_max_logprob_diff"] = self.engines.gate(self.step_index, score, diagnose)
        return metrics

    def _signals(self):
        """SIGTERM / SIGUSR1 (Slurm's pre-emption warning) set a flag the loop checks after each step
        (``any_rank_signalled``: all ranks together)."""

        def handler(signum, frame):
            self._stop_signal = signum

        return stop_signals(handler)

    def shutdown(self) -> None:
        """Stops the engines (disaggregated ones are told to, if the run ended early: an error)."""
        from megatron_empg.mcore import parallel_state

        self.engines.close()
        parallel_state.destroy_model_parallel()
