"""One RL step on the trainer's own path, per configuration: old pass, anchor pass, update, EMA;
tokens/s, model FLOP/s and MFU, the CUDA allocator's peak; and one checkpoint save timed against a
plain write of the same bytes to the same disk. Writes one JSON record per configuration.

    python benchmarks/train_step.py                      # CPU flow check: tiny-qwen2, fp32, toy sizes
    python benchmarks/train_step.py --model deepseek-r1-distill-qwen-1.5b --dtype bf16 --peak-tflops 989 \\
        --case attention=unfused,tokens=2048 --case attention=sdpa,tokens=2048 \\
        --case attention=sdpa,tokens=8192 --case attention=sdpa,tokens=16384,recompute=full \\
        --checkpoint --out benchmarks/results/train_step_gpu.json

A case is ``key=value`` pairs: ``attention`` (a ``model.attention_backend``: te, sdpa, unfused;
default sdpa), ``tokens`` (the token budget of a packed micro-batch, ``train.max_tokens_per_microbatch``;
default 2048), ``recompute`` (none, selective, full), ``kl`` (the recipe's KL estimator, or topk:
a reverse Top-k KL with k = ``--k``), ``packed`` (1, or 0: one right-padded row per sequence),
``fusions`` (auto: ``mcore.fusions.fusion_plan`` for this machine; off), ``forward_tokens`` (the
old and anchor passes' budget, ``train.max_tokens_per_forward_microbatch``; 0: the update's rows).
One process (DP 1, TP 1),
the model with random weights (``--model``, changed by ``--model-override a=b``: e.g. a mixture of
experts at fewer layers), the loss of ``--recipe`` (``algorithm.loss``, bound
by ``trainer.bind.build.bind_loss``), its EMA anchor in bf16 (fp32 master), Megatron DDP + Adam.

Each step's samples are ``--tokens-per-step`` tokens of sequences of exactly ``tokens`` tokens
(``--lengths full``: the worst case of a budget, one sequence filling each row; ``mixed``: lengths
uniform in [tokens / 8, tokens], several per row), a quarter prompt, turned into micro-batches by
``trainer.batching.batch.micro_batches`` as the trainer does. The old pass computes what the bound loss
needs (``StatsPlan``: the policy's top-k for a reverse Top-k KL), the anchor pass the anchor's
log-probs (at those ids), with the vocab kernels of ``parallel.vocab_parallel`` (the fused Triton
ones on CUDA). Every stage is timed between two device synchronizes; medians over ``--repeats``
steps after ``--warmup``.

Model FLOPs of a step (``flops`` in each record): per token, 2 N forward (N = the matmul
parameters: the layers and the output layer, not the embedding lookup; a mixture of experts counts
the router and the ``moe_router_topk`` experts a token uses), x3 for forward + backward;
attention 4 L d_attn per token and layer forward for a sequence of L tokens (d_attn = heads x
head_dim: QK^T and AV), halved for causal masking in ``mfu`` (the FLOPs the model needs) and not
halved in ``mfu_megatron`` (Megatron-LM's ``num_floating_point_operations`` convention, that of the
13.6 % measured earlier); the step is two forward passes (old, anchor) and one update. Recompute
is not counted (model FLOPs). MFU = achieved / ``--peak-tflops``.

A mixture of experts (a model with ``num_experts``, e.g. ``--model qwen3-30b-a3b``): ``--num-layers N``
(default 4 of its layers; ``--model-override num_layers=N`` as well), ``--moe-experts
grouped,sequential`` (``model.moe_experts`` per case: each ``--case`` runs once per name, in that
order, in the same process; ``--sequential-repeats R`` runs the sequential cases at fewer steps,
stated in each record's ``repeats``). Each record then also carries ``moe_experts``, ``num_layers``,
``moe_block_mfu`` and ``moe_block_seconds``: the MoE blocks alone (each layer's ``MoELayer``:
router, token permutation, experts, unpermutation) timed *inside* the same steps by CUDA events
(``time.perf_counter`` on CPU) recorded at each ``MoELayer`` call's forward start and end (module
forward pre-/post-hooks) and at its backward start and end (tensor hooks on the gradient of its
output and of its input, which only the MoE block consumes), summed over layers, micro-batches and
passes (old, anchor, update), median over the repeats (``moe_block_timing`` says so); their FLOPs
are the router and the ``moe_router_topk`` experts' GEMMs, x5 as above. ``flops`` states the output
layer's share (``output_layer_share_of_matmul_flops``, ``..._of_step_flops``) and the MoE blocks'.
One GPU at EP 1: the dispatcher permutes tokens locally, there is no all-to-all (``expert_parallel``,
``all_to_all`` in the record). ``moe_comparison`` (grouped against sequential, same case) and
``goals`` (issue 44: step MFU >= 30 %, MoE blocks >= 35 %, grouped >= 5x sequential, peak within 5 %
of the plan) are written at the report's top level; nothing asserts them.

Every record carries ``planned_peak_gib`` (and per stage): ``empg plan``'s allocator peak for the
same configuration (``benchmarks/plan_vs_gpu.py``'s ``record_configuration`` and
``planned_peaks``), and ``peak_vs_plan`` = planned / measured - 1 on CUDA.

``--checkpoint``: after the first case that fits, one save (``mcore.checkpoint.save_checkpoint``:
policy, optimizer, anchor master, RNG) into ``--checkpoint-dir``, then a plain sequential write of
the same number of bytes to a file in the same directory (``common.plain_write``: 8 MiB
writes, fsync), each removed after; ``benchmarks/checkpoint_save.py`` has the repeated, itemised
measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import commit, plain_write  # noqa: E402
from moe_step import (  # noqa: E402  (the MoE blocks' timer, FLOPs, record fields, comparison, goals)
    MOE_LAYERS,
    MoeBlockTimer,
    moe_block_flops,
    moe_comparison,
    moe_goals,
    moe_record,
    moe_summary,
    print_comparison,
)
from op_classes import OpProfile  # noqa: E402  (the step's time by op class)

from megatron_empg.config import ParallelConfig, RunConfig, load_config, load_model_config  # noqa: E402

CUDA = torch.cuda.is_available()
STAGES = ("old_pass", "anchor_pass", "update", "ema_update")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Case:
    attention: str = "sdpa"
    tokens: int = 2048
    recompute: str = "none"
    kl: str = "recipe"
    packed: bool = True
    fusions: str = "auto"
    forward_tokens: int = 0
    experts: str = ""  # model.moe_experts ("": the model's setting); --moe-experts fills it in
    warmup: int = -1  # -1: --warmup
    repeats: int = 0  # 0: --repeats (--sequential-repeats for sequential experts)

    @classmethod
    def parse(cls, text: str) -> Case:
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in fields:
                raise SystemExit(f"--case {text!r}: unknown key {key!r}; expected {sorted(fields)}")
            values[key] = (
                int(value)
                if key in ("tokens", "forward_tokens", "warmup", "repeats")
                else value in ("1", "true")
                if key == "packed"
                else value
            )
        return cls(**values)

    def name(self) -> str:
        layout = "packed" if self.packed else "padded"
        forward = f" forward={self.forward_tokens}" if self.forward_tokens else ""
        experts = f" experts={self.experts}" if self.experts else ""
        return (
            f"{self.attention} {layout} {self.tokens}{forward} recompute={self.recompute} kl={self.kl} "
            f"fusions={self.fusions}{experts}"
        )


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _timed(fn, peaks: dict, stage: str, ops: OpProfile | None = None):
    """fn() between two device synchronizes: (its result, seconds); the allocator's peak during it
    is kept as the max over calls in ``peaks[stage]``; with ``ops``, profiled by op class."""
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    _sync()
    start = time.perf_counter()
    with ops.stage(stage) if ops is not None else contextlib.nullcontext():
        out = fn()
    _sync()
    elapsed = time.perf_counter() - start
    if CUDA:
        peaks[stage] = max(peaks.get(stage, 0), torch.cuda.max_memory_allocated())
    return out, elapsed


def step_flops(model_cfg, lengths: list[int]) -> dict:
    """Model FLOPs of one step (two forward passes and one update) over sequences of ``lengths``
    tokens (module docstring); with and without the causal halving of attention; the output layer's
    share and, for a mixture of experts, the MoE blocks' (router and the experts a token uses)."""
    embedding = model_cfg.vocab_size * model_cfg.hidden_size
    active = model_cfg.num_parameters(active=True)  # a mixture of experts: the experts a token uses
    matmul_params = active - embedding + (embedding if model_cfg.tie_word_embeddings else 0)
    tokens = sum(lengths)
    d_attn = model_cfg.num_attention_heads * model_cfg.kv_channels
    attention_full = sum(4 * length * length * d_attn for length in lengths) * model_cfg.num_layers
    linear = 2 * matmul_params * tokens
    # old + anchor forward, update forward + backward (2x); a LoRA policy's frozen base takes no weight
    # gradients (backward 1x; the adapters' own FLOPs, 2 r (in + out) per token and projection, left out)
    lora = model_cfg.lora is not None
    passes = 2 + (2 if lora else 3)
    causal = passes * (linear + attention_full / 2)
    output_params = model_cfg.vocab_size * model_cfg.hidden_size  # the output layer (tied or not)
    out = {
        "matmul_params": matmul_params,
        "step_flops_causal": causal,
        "step_flops_megatron": passes * (linear + attention_full),
        "formula": f"{passes} x (2 N tokens + sum_seq 4 L^2 heads head_dim layers [x 1/2 causal]); N = layer "
        "and output-layer matmul parameters; 5 = old + anchor forward + update (forward + 2x backward)"
        + ("; LoRA: 4, the frozen base's backward computes input gradients only" if lora else ""),
        "output_layer_params": output_params,
        "output_layer_share_of_matmul_flops": output_params / matmul_params,
        "output_layer_share_of_step_flops": passes * 2 * output_params * tokens / causal,
    }
    if model_cfg.is_moe:
        out.update(moe_block_flops(model_cfg, tokens, passes, causal))
    return out


def _samples(vocab: int, case: Case, tokens_per_step: int, lengths_mode: str, seed: int):
    from megatron_empg.trainer.batching.batch import Sample

    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens_per_step:
        if lengths_mode == "full":
            lengths.append(case.tokens)
        else:
            lengths.append(int(torch.randint(case.tokens // 8, case.tokens + 1, (1,), generator=g)))
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        prompt = max(1, length // 4)
        response = ids[prompt:]
        samples.append(Sample(ids[:prompt], response, [-1.0] * len(response), "stop", group=i // 8))
    advantages = torch.randn(len(samples), generator=g).tolist()
    return samples, advantages


def _micro_batches(samples, advantages, case: Case, device):
    from megatron_empg.trainer.batching.batch import MicroBatchPlan, micro_batches

    plan = (
        MicroBatchPlan(packing=True, max_tokens=case.tokens)
        if case.packed
        else MicroBatchPlan(packing=False, micro_batch_size=max(1, case.tokens // max(s.length for s in samples)))
    )
    return [mb.to(device) for mb in micro_batches(samples, advantages, plan)]


def run_case(args, case: Case, recipe: RunConfig, progress: dict) -> tuple[dict, dict]:
    """(the record, what a checkpoint save needs) of one case."""
    from megatron_empg.config import OptimizerConfig
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.attention_backends import resolve_attention_backend
    from megatron_empg.mcore.fusions import FUSIONS, FusionPlan, fusion_plan
    from megatron_empg.mcore.model import build_gpt_model, recompute_overrides
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.parallel.rl_loss import loss_units
    from megatron_empg.trainer.batching.forward_batch import ForwardPlan, forward_rows
    from megatron_empg.trainer.bind.build import bind_loss

    model_cfg = load_model_config(args.model, case_overrides(args, case))
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda") if CUDA else torch.device("cpu")
    attention = resolve_attention_backend(case.attention)
    fusions = fusion_plan(attention, cuda=CUDA)
    if case.fusions == "off":
        fusions = FusionPlan(dict.fromkeys(FUSIONS, False), dict.fromkeys(FUSIONS, "off for this case"))
    loss_cfg = recipe.algorithm.loss
    if case.kl == "topk":
        loss_cfg = dataclasses.replace(loss_cfg, kl="topk", kl_args={"direction": "reverse", "importance_weight": True})
    elif case.kl != "recipe":
        loss_cfg = dataclasses.replace(loss_cfg, kl=case.kl, kl_args={})
    loss, plan = bind_loss(loss_cfg, vocab_size=model_cfg.vocab_size, topk=args.k)
    peaks: dict[str, int] = {}
    progress.update(stage="build", step=None)
    policy = build_gpt_model(
        model_cfg,
        parallel,
        params_dtype=dtype,
        attention_backend=attention.name,
        fusions=fusions,
        **recompute_overrides(case.recompute),
    )
    settings = OptimizerConfig(lr=1e-6, clip_grad=1.0)
    ddp = wrap_with_ddp(policy, settings)
    optimizer = build_optimizer(ddp, settings)
    scheduler = build_scheduler(optimizer, settings)
    if model_cfg.lora is not None:  # the base with averaged adapters
        from megatron_empg.mcore.lora.anchor import AdapterAnchor

        anchor = AdapterAnchor(ddp, optimizer, tau=0.95, period=1)
    else:
        anchor = EmaAnchor.from_configs(
            model_cfg,
            parallel,
            ddp,
            optimizer,
            tau=0.95,
            period=1,
            compute_dtype=dtype,
            attention_backend=attention.name,
            fusions=fusions,
        )
    built_bytes = torch.cuda.memory_allocated() if CUDA else None
    moe_timer = MoeBlockTimer([*ddp, *anchor.models]) if model_cfg.is_moe else None
    warmup = args.warmup if case.warmup < 0 else case.warmup
    repeats = case.repeats or (
        args.sequential_repeats if model_cfg.is_moe and model_cfg.moe_experts == "sequential" else None
    )
    repeats = repeats or args.repeats
    moe_times: list[dict[str, float]] = []
    vocab = model_cfg.vocab_size
    old_request = StatsRequest(vocab_size=vocab, k=plan.old_topk, with_entropy=False)
    anchor_request = StatsRequest(
        vocab_size=vocab,
        k=plan.anchor_topk,
        with_entropy=False,
        extra_ids_key="topk_ids" if plan.anchor_at_old_topk else None,
    )
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    lengths: list[int] = []
    ops = OpProfile() if args.profile else None
    for step in range(warmup + repeats + bool(ops)):  # the profiled step: one more, not timed
        profiled = ops if step == warmup + repeats else None
        progress.update(step=step, stage="batch")
        samples, advantages = _samples(vocab, case, args.tokens_per_step, args.lengths, seed=step)
        lengths = [s.length for s in samples]
        mbs = _micro_batches(samples, advantages, case, device)
        rows = forward_rows(mbs, ForwardPlan(max_tokens=case.forward_tokens or None))
        progress["stage"] = "old_pass"
        if moe_timer:
            moe_timer.collect()  # nothing before the step's first pass
        old, t_old = _timed(
            lambda: rows.split_stats(forward_stats(ddp, rows.batches, old_request, groups)), peaks, "old_pass", profiled
        )
        moe_by_pass = {"old_pass": moe_timer.collect()["forward"]} if moe_timer else {}
        for mb, out in zip(mbs, old, strict=True):
            mb.old_logprobs = out.logprobs
            if plan.old_topk:
                mb.topk_ids = out.topk_ids
        rows = forward_rows(mbs, ForwardPlan(max_tokens=case.forward_tokens or None))  # with the old pass's ids
        progress["stage"] = "anchor_pass"
        with anchor.forward_models() as anchor_models:
            ref, t_anchor = _timed(
                lambda: rows.split_stats(forward_stats(anchor_models, rows.batches, anchor_request, groups)),
                peaks,
                "anchor_pass",
                profiled,
            )
        if moe_timer:
            moe_by_pass["anchor_pass"] = moe_timer.collect()["forward"]
        for mb, out in zip(mbs, ref, strict=True):
            mb.anchor_logprobs = out.logprobs
            if plan.anchor_at_old_topk:
                mb.topk_anchor_logprobs = out.extra_logprobs
        progress["stage"] = "update"
        units = functools.partial(loss_units, agg_mode=loss_cfg.agg_mode)  # a mixture of experts' router losses
        _, t_update = _timed(
            lambda: train_step(ddp, optimizer, scheduler, mbs, loss, groups=groups, loss_units=units),
            peaks,
            "update",
            profiled,
        )
        if moe_timer:
            update = moe_timer.collect()
            moe_by_pass.update(update_forward=update["forward"], update_backward=update["backward"])
        progress["stage"] = "ema_update"
        _, t_ema = _timed(anchor.update, peaks, "ema_update", profiled)
        if warmup <= step < warmup + repeats:
            for stage, t in zip(STAGES, (t_old, t_anchor, t_update, t_ema)):
                times[stage].append(t)
            if moe_timer:
                moe_times.append(moe_by_pass)
    if moe_timer:
        moe_timer.remove()
    medians = {stage: statistics.median(ts) for stage, ts in times.items()}
    step_s = sum(medians.values())
    flops = step_flops(model_cfg, lengths)
    record = {
        "case": case.name(),
        "ok": True,
        "attention_backend": attention.name,
        "packed": case.packed,
        "tokens_per_microbatch": case.tokens,
        "microbatches": len(mbs),
        "forward_tokens_per_microbatch": case.forward_tokens or case.tokens,
        "forward_microbatches": len(rows.batches),
        "sequence_lengths": "full" if args.lengths == "full" else "mixed",
        "recompute": case.recompute,
        "kl": loss_cfg.kl,
        "topk": plan.old_topk or plan.anchor_topk,
        "fusions": {f: v for f, v in fusions.overrides.items() if v},
        "tokens_per_step": sum(lengths),
        "warmup": warmup,
        "repeats": repeats,
        "model": args.model,
        "model_override": case_overrides(args, case),
        "num_layers": model_cfg.num_layers,
        "lora": None
        if model_cfg.lora is None
        else {"rank": model_cfg.lora.rank, "targets": list(model_cfg.lora.targets)},
        "stage_seconds_median": medians,
        "step_seconds": step_s,
        "tokens_per_s": sum(lengths) / step_s,
        "achieved_tflops": flops["step_flops_causal"] / step_s / 1e12,
        "flops": flops,
    }
    peak = args.peak_tflops
    record["mfu"] = flops["step_flops_causal"] / step_s / 1e12 / peak if peak else None
    if peak:
        record["mfu_megatron"] = flops["step_flops_megatron"] / step_s / 1e12 / peak
        record["peak_tflops"] = peak
    if model_cfg.is_moe:
        record.update(moe_record(model_cfg, policy, parallel, moe_timer, moe_times, flops, step_s, peak))
    if ops is not None:
        record.update(ops.record())
    record["peak_gib"] = max(peaks.values()) / GIB if CUDA else None
    if CUDA:
        record["peak_gib_by_stage"] = {k: v / GIB for k, v in peaks.items()}
        record["allocated_after_build_gib"] = built_bytes / GIB
    record.update(_planned(record, args))
    state = {"models": ddp, "optimizer": optimizer, "scheduler": scheduler, "anchor": anchor, "groups": groups}
    return record, {**state, "lora": model_cfg.lora is not None}


def case_overrides(args, case: Case) -> list[str]:
    """The model overrides of ``case``: ``--model-override``, ``--num-layers`` (a mixture of
    experts: 4 unless given), ``moe_experts`` of the case."""
    overrides = list(args.model_override)
    layers = args.num_layers
    if layers is None and not any(o.startswith("num_layers=") for o in overrides):
        if load_model_config(args.model, overrides).is_moe:
            layers = MOE_LAYERS
    if layers is not None:
        overrides.append(f"num_layers={layers}")
    if case.experts:
        overrides.append(f"moe_experts={case.experts}")
    return overrides


def _planned(record: dict, args) -> dict:
    """``empg plan``'s allocator peak for the record's configuration (``plan_vs_gpu``), total and
    per stage, and the measured peak against it."""
    from plan_vs_gpu import STAGES as PLAN_STAGES
    from plan_vs_gpu import planned_peaks, record_configuration

    try:
        planned = planned_peaks(record_configuration(record, {"model": args.model}))
    except Exception as err:  # noqa: BLE001 - the measurement stands without its plan
        return {"planned_peak_gib": None, "planned_peak_error": f"{type(err).__name__}: {err}"[:500]}
    out = {
        "planned_peak_gib": max(planned.values()) / GIB,
        "planned_peak_gib_by_stage": {k: v / GIB for k, v in planned.items()},
        "planned_stages": {k: list(v) for k, v in PLAN_STAGES.items()},
    }
    if record.get("peak_gib"):
        out["peak_vs_plan"] = out["planned_peak_gib"] / record["peak_gib"] - 1
    return out


def time_checkpoint(state: dict, directory: Path) -> dict:
    """One save of ``state`` (``run_case``'s) against a plain write of as many bytes, same disk
    (``common.plain_write``: the streaming writer's 8 MiB pieces, fsync). Megatron's
    writer process is started first, as the trainer does at start-up."""

    from megatron_empg.mcore.checkpoint import (
        CheckpointParts,
        ModelMetadata,
        SaveOptions,
        TrainState,
        save_checkpoint,
    )
    from megatron_empg.mcore.checkpoint.writer import start_checkpoint_writer

    start_checkpoint_writer()
    directory.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckpt_", dir=directory))
    try:
        _sync()
        start = time.perf_counter()
        parts = CheckpointParts(
            state["models"], optimizer=state["optimizer"], scheduler=state["scheduler"], anchor=state["anchor"]
        )
        lora_base = {"path": "(a random base)", "fingerprint": "-"} if state["lora"] else None  # adapters only
        meta = ModelMetadata(base=lora_base)
        saved = save_checkpoint(
            root, TrainState(1), parts, state["groups"], options=SaveOptions(keep_last=1), model=meta
        )
        _sync()
        save_s = time.perf_counter() - start
        num_bytes = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_s = plain_write(directory / "plain_write.bin", num_bytes)
    return {
        "checkpoint_s": save_s,
        "checkpoint_gb": num_bytes / 1e9,
        "plain_write_s": write_s,
        "write_gb_per_s": num_bytes / 1e9 / write_s,
        "checkpoint_gb_per_s": num_bytes / 1e9 / save_s,
        "ratio_to_plain_write": save_s / write_s,
        "directory": str(directory),
        "filesystem": _filesystem(directory),
    }


def _filesystem(path: Path) -> str:
    try:
        return subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()[
            -1
        ]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _failure(case: Case, err: BaseException, progress: dict) -> dict:
    out = {
        "case": case.name(),
        "ok": False,
        "attention_backend": case.attention,
        "tokens_per_microbatch": case.tokens,
        "recompute": case.recompute,
        "packed": case.packed,
        "moe_experts": case.experts or None,
        "oom": isinstance(err, torch.cuda.OutOfMemoryError),
        "failed_at": dict(progress),
        "error": f"{type(err).__name__}: {err}"[:1500],
    }
    if CUDA:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def _machine() -> dict:
    from megatron_empg.mcore.attention import varlen_attention
    from megatron_empg.mcore.attention_backends import te_import_error

    varlen = varlen_attention()
    info = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "torch_threads": torch.get_num_threads(),
        "transformer_engine": te_import_error() is None,
        "varlen_attn": varlen.describe() if varlen else None,
    }
    try:
        import megatron.core
        import triton

        info.update(megatron_core=getattr(megatron.core, "__version__", None), triton=triton.__version__)
    except ImportError:
        pass
    if CUDA:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            torch_cuda=torch.version.cuda,
            device_total_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
        )
    return info


def _summary(record: dict) -> str:
    if not record["ok"]:
        return (
            f"{record['case']}: {'OUT OF MEMORY' if record['oom'] else 'FAILED'} at {record['failed_at']}: "
            f"{record['error'][:300]}"
        )
    stages = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in record["stage_seconds_median"].items())
    line = f"{record['case']}: {record['tokens_per_s']:.0f} tokens/s"
    if record.get("mfu") is not None:
        line += f", MFU {100 * record['mfu']:.1f}% (Megatron convention {100 * record['mfu_megatron']:.1f}%)"
    line += moe_summary(record)
    if record.get("peak_gib") is not None:
        line += f", peak {record['peak_gib']:.1f} GiB"
    if record.get("planned_peak_gib") is not None:
        line += f" (plan {record['planned_peak_gib']:.1f} GiB)"
    return f"{line} | {stages}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: tiny-qwen2 on CPU, the recipe's model on CUDA")
    p.add_argument(
        "--model-override",
        action="append",
        default=[],
        help="a dotted override of the model config (repeatable), e.g. num_layers=4",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help=f"the model's layers (default: the model's; a mixture of experts: {MOE_LAYERS})",
    )
    p.add_argument(
        "--moe-experts",
        default=None,
        help="comma-separated model.moe_experts names (grouped,sequential): every case runs once per name",
    )
    p.add_argument(
        "--sequential-repeats",
        type=int,
        default=None,
        help="timed steps of the sequential-experts cases (default: --repeats)",
    )
    p.add_argument("--recipe", default=str(REPO / "recipes/r1_distill_qwen_1.5b_math_ema_pg.yaml"))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16" if CUDA else "fp32")
    p.add_argument("--case", action="append", type=Case.parse, help="repeatable; default: one sdpa case")
    p.add_argument("--tokens-per-step", type=int, default=32768 if CUDA else 512)
    p.add_argument("--lengths", choices=("full", "mixed"), default="full")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for the MFU (H100 SXM: 989)")
    p.add_argument("--checkpoint", action="store_true", help="time one save against a plain write (first case)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more step under the torch profiler: time by op class (op_classes.py)",
    )
    p.add_argument("--checkpoint-dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=str(REPO / f"benchmarks/results/train_step_{'gpu' if CUDA else 'cpu'}.json"))
    args = p.parse_args(argv)
    recipe = load_config(RunConfig, args.recipe)
    args.model = args.model or (recipe.model if CUDA else "tiny-qwen2")
    cases = args.case or [Case(tokens=2048 if CUDA else 128)]
    if args.moe_experts:
        names = [n for n in args.moe_experts.split(",") if n]
        cases = [dataclasses.replace(c, experts=n) for c in cases for n in names]

    from megatron_empg.mcore.parallel_state import destroy_model_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    report = {
        "benchmark": "train_step",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "params": {k: v for k, v in vars(args).items() if k != "case"},
        "cases": [c.name() for c in cases],
        "records": [],
    }
    try:
        for case in cases:
            progress: dict = {}
            state = None
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            try:
                record, state = run_case(args, case, recipe, progress)
                if args.checkpoint and "checkpoint" not in report:
                    report["checkpoint"] = {"case": case.name(), **time_checkpoint(state, Path(args.checkpoint_dir))}
                    record.update(report["checkpoint"])
            except torch.cuda.OutOfMemoryError as err:
                record = _failure(case, err, progress)
            finally:
                state = None
                destroy_model_parallel()
                gc.collect()
                if CUDA:
                    torch.cuda.empty_cache()
            record.update(device=report["machine"]["device"], commit=report["commit"])
            report["records"].append(record)
            print(_summary(record), flush=True)
            comparison = moe_comparison(report["records"])
            if comparison:
                report["moe_comparison"] = comparison
            goals = moe_goals(report["records"], comparison)
            if goals:
                report["goals"] = goals
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        dist.destroy_process_group()
    if "checkpoint" in report:
        c = report["checkpoint"]
        print(
            f"checkpoint: {c['checkpoint_gb']:.1f} GB in {c['checkpoint_s']:.1f} s; plain write {c['plain_write_s']:.1f} s "
            f"({c['write_gb_per_s']:.2f} GB/s): {c['ratio_to_plain_write']:.2f}x",
            flush=True,
        )
    print_comparison(report.get("moe_comparison", []))
    print(f"wrote {args.out}")
    if not all(r["ok"] for r in report["records"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
