"""Where a run's work lands on a world of processes, checked from the config alone.

Torch-free (the config module and PyYAML only): ``launch_check`` runs it on a login node before a
job is queued, and ``trainer.bind.build.bind`` runs it first of all its checks. Every error is a
``ConfigError`` naming the dotted field and what was expected.

    layout = check_layout(config, config.model_config(), world_size=8)
    layout.dp, layout.samples_per_replica, layout.micro_batches_per_replica
"""

from __future__ import annotations

import dataclasses
import math

from megatron_empg.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from megatron_empg.rollout.engines import ENGINES, EngineKind


@dataclasses.dataclass(frozen=True)
class Layout:
    """The grid of a run: ``world_size = tp * pp * cp * dp`` training processes; each data-parallel replica
    takes ``prompts_per_replica`` whole prompt groups per step, ``samples_per_replica`` samples in
    ``micro_batches_per_replica`` micro-batches (None: as many as ``train.max_tokens_per_microbatch``
    needs, which depends on the lengths sampled)."""

    world_size: int
    tp: int
    pp: int
    dp: int
    prompts_per_replica: int
    samples_per_replica: int
    micro_batches_per_replica: int | None
    engines: int  # rollout engines (``rollout.engines``), each serving dp / engines replicas
    engine_ranks: int = 0  # ranks that only run engines (``rollout.placement: disaggregated``), the last ones
    cp: int = 1  # context-parallel ranks per replica (each holds a share of every row)

    @property
    def training_ranks(self) -> int:
        """The ranks that train: ``tp * pp * cp * dp``, the first of the world."""
        return self.world_size - self.engine_ranks


def check_layout(config: RunConfig, model: ModelConfig, world_size: int) -> Layout:
    """The ``Layout`` of ``config`` on ``world_size`` processes, after checking that it fits:

    - the model splits over TP (attention heads and query groups) and PP (layers, with VPP);
    - TP x PP divides the world (the rest is data parallel);
    - each step's prompts split into whole groups per replica, then whole micro-batches and
      mini-batches (advantages are per group; every replica takes the same number of optimizer
      steps);
    - the engine (``rollout.engine``) can run where it is asked to (its own process, or a
      training rank's), and its tensor parallelism splits the model as vLLM needs (heads; query
      groups split or replicated);
    - the engines (``rollout.engines``) divide the replicas, each at the training TP;
    - disaggregated (``rollout.placement``): the world is the training ranks (the grid above)
      plus ``rollout.engine_ranks``, whose engines (``rollout.tensor_parallel_size`` ranks each)
      divide the replicas.
    - the forward-only passes' rows (``train.max_tokens_per_forward_microbatch``) hold the
      update's widest row.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    parallel, train, rollout = config.parallel, config.train, config.rollout
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    engine_ranks = rollout.engine_ranks if rollout.disaggregated else 0
    training = world_size - engine_ranks
    if training < 1:
        raise ConfigError(
            "rollout.engine_ranks", f"{engine_ranks} engine ranks leave no training rank in a world of {world_size}"
        )
    grid = f"TP {tp} x PP {pp}" + (f" x CP {cp}" if cp > 1 else "")
    if training % (tp * pp * cp):
        of = (
            f"the {training} training ranks (world {world_size} - rollout.engine_ranks {engine_ranks})"
            if engine_ranks
            else f"the world of {world_size} processes"
        )
        raise ConfigError(
            "parallel.tensor_model_parallel_size",
            f"{of} is not divisible by parallel.tensor_model_parallel_size x "
            f"parallel.pipeline_model_parallel_size{' x parallel.context_parallel_size' if cp > 1 else ''} = "
            f"{grid.replace('TP ', '').replace('PP ', '').replace('CP ', '')}",
        )
    _check_engine_process(config, engine_kind(config), training)
    try:
        parallel.validate_for(model)
    except ConfigError as error:
        raise ConfigError(f"parallel.{error.field}", error.reason) from None
    _check_context_parallel(config, model)
    _check_experts(config, model, training)
    dp = training // (tp * pp * cp)
    where = f"world {world_size} / ({grid})" if not engine_ranks else f"{training} training ranks / ({grid})"
    if train.prompts_per_step % dp:
        raise ConfigError(
            "train.prompts_per_step",
            f"must be divisible by the data-parallel size {dp} ({where}: each replica takes whole prompt groups), "
            f"got {train.prompts_per_step}",
        )
    dynamic = config.algorithm.dynamic_sampling
    if dynamic is not None and dynamic.prompts_per_gen_batch is not None:
        field = "algorithm.dynamic_sampling.prompts_per_gen_batch"
        if dynamic.prompts_per_gen_batch % dp:
            raise ConfigError(
                field,
                f"must be divisible by the data-parallel size {dp} ({where}), got {dynamic.prompts_per_gen_batch}",
            )
        if dynamic.prompts_per_gen_batch * dynamic.max_num_gen_batches < train.prompts_per_step:
            raise ConfigError(
                field,
                f"x max_num_gen_batches {dynamic.max_num_gen_batches} = "
                f"{dynamic.prompts_per_gen_batch * dynamic.max_num_gen_batches} prompts cannot "
                f"fill train.prompts_per_step={train.prompts_per_step}",
            )
    prompts = train.prompts_per_step // dp
    samples = prompts * config.rollout.sampling.n
    if train.max_tokens_per_microbatch is not None:
        if samples % config.algorithm.mini_batches:
            raise ConfigError(
                "algorithm.mini_batches",
                f"must divide each data-parallel replica's samples, train.prompts_per_step / {dp} x "
                f"rollout.sampling.n = {samples} ({where}), got {config.algorithm.mini_batches}",
            )
        micro_batches = None
    else:
        micro_batches = _count_micro_batches(config, samples, dp, where)
    _check_engine_split(config, model)
    _check_recompute(config, model)
    _check_forward_budget(config)
    engines = _check_engine_placement(config, dp, where)
    return Layout(world_size, tp, pp, dp, prompts, samples, micro_batches, engines, engine_ranks, cp)


def _check_experts(config: RunConfig, model: ModelConfig, training: int) -> None:
    """A mixture of experts: the expert grid (ETP x EP x PP) divides the training ranks, TP > 1
    comes with sequence parallelism, and tokens cross expert-parallel ranks by alltoall: Megatron's allgather dispatcher exchanges as many tokens
    from every rank, while packed micro-batches differ in length from one data-parallel rank to the
    next (a gloo or NCCL size mismatch a few steps in)."""
    parallel = config.parallel
    if not model.is_moe:
        return
    if training % parallel.expert_grid_size:
        raise ConfigError(
            "parallel.expert_model_parallel_size",
            f"the {training} training ranks are not divisible by parallel.expert_tensor_parallel_size x "
            f"parallel.expert_model_parallel_size x parallel.pipeline_model_parallel_size = {parallel.expert_tp_size} x "
            f"{parallel.expert_model_parallel_size} x {parallel.pipeline_model_parallel_size}",
        )
    if parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel",
            "a mixture of experts trains at tensor_model_parallel_size > 1 only with sequence parallelism (Megatron's "
            "MoE layer refuses otherwise), which needs model.attention_backend te; or use TP 1 and expert parallelism",
        )
    if parallel.expert_model_parallel_size > 1 and parallel.moe_token_dispatcher_type == "allgather":
        raise ConfigError(
            "parallel.moe_token_dispatcher_type",
            "allgather needs the same number of tokens on every expert-parallel rank, which the data-parallel "
            "ranks' micro-batches do not have; use alltoall with expert_model_parallel_size > 1",
        )


def _check_context_parallel(config: RunConfig, model: ModelConfig) -> None:
    """Context parallelism splits packed rows (``train.packing``) in the sdpa or TE attention, and
    a sequence of ``train.max_seq_len`` (padded to 2 x CP) must fit a row of CP x the budget."""
    train, cp = config.train, config.parallel.context_parallel_size
    if cp == 1:
        budget = train.max_tokens_per_microbatch
        if budget is not None and budget < train.max_seq_len:
            raise ConfigError(
                "train.max_tokens_per_microbatch",
                f"{budget} cannot hold a sequence of max_seq_len={train.max_seq_len} tokens; set it to at least that",
            )
        return
    field = "parallel.context_parallel_size"
    if not train.packing:
        raise ConfigError(field, f"{cp} splits packed rows: it needs train.packing true")
    if model.attention_backend not in ("sdpa", "te"):
        raise ConfigError(
            field,
            f"{cp} needs model.attention_backend sdpa or te (their context-parallel "
            f"attention), got {model.attention_backend}",
        )
    longest = -(-train.max_seq_len // (2 * cp)) * 2 * cp
    budget = train.max_tokens_per_microbatch
    if budget is not None and budget * cp < longest:
        raise ConfigError(
            "train.max_tokens_per_microbatch",
            f"{budget} per context-parallel rank x {cp} ranks cannot "
            f"hold a sequence of max_seq_len={train.max_seq_len} padded to a multiple of 2 x CP "
            f"({longest}); set it to at least {-(-longest // cp)}",
        )


def _count_micro_batches(config: RunConfig, samples: int, dp: int, where: str) -> int:
    """Micro-batches of ``train.micro_batch_size`` samples: whole, and whole in every mini-batch."""
    train = config.train
    if samples % train.micro_batch_size:
        raise ConfigError(
            "train.micro_batch_size",
            f"must divide each data-parallel replica's samples, train.prompts_per_step / {dp} x "
            f"rollout.sampling.n = {samples} ({where}), got {train.micro_batch_size}",
        )
    micro_batches = samples // train.micro_batch_size
    if micro_batches % config.algorithm.mini_batches:  # advantages come first: a group may span mini-batches
        raise ConfigError(
            "algorithm.mini_batches",
            f"must divide each data-parallel replica's {micro_batches} micro-batches of "
            f"train.micro_batch_size={train.micro_batch_size} ({where}), got {config.algorithm.mini_batches}",
        )
    return micro_batches


def row_multiple(parallel: ParallelConfig) -> int:
    """What every micro-batch's row length is rounded up to: 8, or a multiple of TP as well under
    sequence parallelism (the rows are split over the TP ranks)."""
    return math.lcm(8, parallel.tensor_model_parallel_size) if parallel.sequence_parallel else 8


def widest_row(train: TrainConfig, parallel: ParallelConfig) -> int:
    """The most tokens (padding included) a packed row of the update can have on one rank: its
    token budget, or ``micro_batch_size`` sequences of ``max_seq_len`` without one (a CP rank's
    share of them), rounded up to ``row_multiple``."""
    tokens = train.max_tokens_per_microbatch or -(
        -train.micro_batch_size * train.max_seq_len // parallel.context_parallel_size
    )
    return -(-tokens // row_multiple(parallel)) * row_multiple(parallel)


def _check_forward_budget(config: RunConfig) -> None:
    """A forward row holds whole update rows: its budget must hold the widest."""
    train = config.train
    budget, widest = train.max_tokens_per_forward_microbatch, widest_row(train, config.parallel)
    if budget is not None and budget < widest:
        of = (
            f"train.max_tokens_per_microbatch={train.max_tokens_per_microbatch}"
            if train.max_tokens_per_microbatch
            else f"train.micro_batch_size={train.micro_batch_size} x train.max_seq_len={train.max_seq_len}"
        )
        raise ConfigError(
            "train.max_tokens_per_forward_microbatch",
            f"{budget} cannot hold the update's widest packed row, {of} rounded up to a multiple of "
            f"{row_multiple(config.parallel)} = {widest} tokens; set it to at least that",
        )


def _check_recompute(config: RunConfig, model: ModelConfig) -> None:
    """Full recompute checkpoints units of ``train.recompute_num_layers`` layers of a model chunk."""
    train, parallel = config.train, config.parallel
    chunks = parallel.pipeline_model_parallel_size * (parallel.virtual_pipeline_model_parallel_size or 1)
    chunk_layers = model.num_layers // chunks
    if train.recompute == "full" and train.recompute_num_layers > chunk_layers:
        raise ConfigError(
            "train.recompute_num_layers",
            f"{train.recompute_num_layers} exceeds the {chunk_layers} layers of each model chunk (model.num_layers "
            f"{model.num_layers} / PP / VPP)",
        )


def _check_engine_placement(config: RunConfig, dp: int, where: str) -> int:
    """E (``rollout.engines``) divides the replicas; several engines run at the training TP (v1:
    an engine's GPUs are its owner's tensor-parallel group, within one node)."""
    engines = config.rollout.num_engines(dp)
    if config.rollout.disaggregated:
        if dp % engines:
            raise ConfigError(
                "rollout.engine_ranks",
                f"{config.rollout.engine_ranks} engine ranks / rollout.tensor_parallel_size "
                f"{config.rollout.tensor_parallel_size} = {engines} engines must divide the data-parallel size {dp} "
                f"({where}): each engine samples whole replicas",
            )
        return engines  # on their own ranks: any engine TP
    if dp % engines:
        raise ConfigError(
            "rollout.engines",
            f"{engines} engines must divide the data-parallel size {dp} ({where}): each engine serves whole "
            f"replicas; use per_replica, single or a divisor of {dp}",
        )
    tp, engine_tp = config.parallel.tensor_model_parallel_size, config.rollout.tensor_parallel_size
    if engines > 1 and engine_tp != tp:
        raise ConfigError(
            "rollout.tensor_parallel_size",
            f"{engine_tp} must equal parallel.tensor_model_parallel_size={tp} with {engines} engines (each runs on "
            f"its owner's tensor-parallel GPUs); set it to {tp}, or rollout.engines=single",
        )
    return engines


def engine_kind(config: RunConfig) -> EngineKind:
    """The ``rollout.engines.ENGINES`` entry of ``rollout.engine``."""
    name = config.rollout.engine
    if name not in ENGINES:
        raise ConfigError("rollout.engine", f"unknown name {name!r}; expected one of {sorted(ENGINES)}")
    return ENGINES[name]


def _check_engine_process(config: RunConfig, engine: EngineKind, world_size: int) -> None:
    name = config.rollout.engine
    if config.weight_sync.transport == "cuda_ipc":
        if config.rollout.in_process:
            raise ConfigError(
                "rollout.in_process",
                "true cannot take weight_sync.transport=cuda_ipc (CUDA cannot open an "
                "IPC handle in the process that made it); set rollout.in_process=false",
            )
        if config.rollout.tensor_parallel_size > 1:
            raise ConfigError(
                "weight_sync.transport",
                f"cuda_ipc serves engines of rollout.tensor_parallel_size 1 for now (got "
                f"{config.rollout.tensor_parallel_size}: every engine worker would read whole buckets from one GPU); "
                "use shm_file",
            )
    if config.rollout.disaggregated and config.rollout.in_process and not engine.in_process_beside_training:
        raise ConfigError(
            "rollout.in_process",
            f"true cannot run engine {name!r} on an engine rank (it would join "
            "the engine ranks' process group); set rollout.in_process=false",
        )
    if config.rollout.partial and not engine.updates_mid_generation:
        able = sorted(n for n, kind in ENGINES.items() if kind.updates_mid_generation)
        raise ConfigError(
            "rollout.partial",
            f"true needs an engine that loads weights between decode steps ({able}); {name!r} does not",
        )
    if not config.rollout.in_process and not engine.own_process:
        raise ConfigError(
            "rollout.in_process", f"false needs an engine that runs in its own process; {name!r} does not"
        )
    if config.rollout.in_process and world_size > 1 and not engine.in_process_beside_training:
        raise ConfigError(
            "rollout.in_process",
            f"true needs a world of one process with engine {name!r} (an in-process engine would join the "
            f"training world of {world_size}); set rollout.in_process=false (and weight_sync.transport=shm_file)",
        )


def _check_engine_split(config: RunConfig, model: ModelConfig) -> None:
    """vLLM's tensor parallelism splits the query heads and splits (or replicates) the KV heads."""
    engine_tp = config.rollout.tensor_parallel_size
    heads, groups = model.num_attention_heads, model.num_query_groups
    if heads % engine_tp:
        raise ConfigError(
            "rollout.tensor_parallel_size", f"{engine_tp} does not divide model.num_attention_heads={heads}"
        )
    if groups % engine_tp and engine_tp % groups:
        raise ConfigError(
            "rollout.tensor_parallel_size",
            f"{engine_tp} neither divides nor is a multiple of model.num_query_groups={groups} (the KV heads)",
        )
