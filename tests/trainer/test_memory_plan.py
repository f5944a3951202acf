"""The memory plan (``trainer.bind.memory_plan``, ``empg plan``) against what it predicts:

- the held terms (weights, gradient buffer, fp32 main parameters, Adam's m and v, the anchor's
  weights and fp32 master) against the bytes of a real Megatron model, DDP, optimizer (after a
  step) and EMA anchor built on CPU ranks, at TP 1, TP 2, PP 2 and DP 2 with the distributed
  optimizer;
- the activations one layer keeps, against the bytes ``saved_tensors_hooks`` sees on the CPU (a
  layer of R1-Distill-Qwen-1.5B's width, bf16, sdpa and unfused), with the CPU's RMSNorm constant;
- every committed GPU measurement of the step (``benchmarks/plan_vs_gpu.py``) within 10 %;
- the bind step: a plan over the GPU is an error naming ``train.memory_check`` with the changes
  that fit (each of which fits when applied), a warning with ``memory_check: warn``; ``empg plan``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from megatron_empg.config import RunConfig, load_config
from tests.dist import run_distributed

DEMO = "recipes/demo_cpu.yaml"
BASE = [
    "model=tiny-qwen2",
    "train.params_dtype=bfloat16",
    "algorithm.anchor.compute_dtype=bfloat16",
    "train.micro_batch_size=8",
    "train.prompts_per_step=4",
    "rollout.in_process=false",
    "weight_sync.transport=shm_file",
]
LAYOUTS = {  # name: (world size, overrides)
    "tp1": (1, []),
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "dp2_distopt": (2, ["optimizer.use_distributed_optimizer=true"]),
    # the row-wise FP8 anchor: the decoder's linears as FP8, the rest dequantized (and, sharded, a
    # flat FP8 buffer of everything for the gather)
    "tp2_fp8": (
        2,
        [
            "parallel.tensor_model_parallel_size=2",
            "algorithm.anchor.compute_dtype=float8_e4m3fn",
            "algorithm.anchor.fp8_output_layer=true",
        ],
    ),
    "dp2_distopt_fp8": (
        2,
        ["optimizer.use_distributed_optimizer=true", "algorithm.anchor.compute_dtype=float8_e4m3fn"],
    ),
    # grouped experts in FP8 too; their flat buffers over expert-DP
    "moe_ep2_fp8": (
        2,
        [
            "model=tiny-qwen3-moe",
            "parallel.expert_model_parallel_size=2",
            "algorithm.anchor.compute_dtype=float8_e4m3fn",
            "model_overrides=[moe_experts=grouped]",
        ],
    ),
    # experts split over EP 2, their optimizer state over expert-DP 1, the rest over DP 2
    "moe_ep2_distopt": (
        2,
        ["model=tiny-qwen3-moe", "parallel.expert_model_parallel_size=2", "optimizer.use_distributed_optimizer=true"],
    ),
    # a frozen bf16 base; the adapters' gradients, float32 mains, Adam and anchor only
    "lora_tp2": (
        2,
        ["parallel.tensor_model_parallel_size=2", 'model_overrides=[lora.rank=8, "lora.targets=[all-linear]"]'],
    ),
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(rank: int, world_size: int, layouts: list[str]) -> dict:
    """Per layout: this rank's pipeline stage and the bytes of each held term, from the objects."""
    from megatron_empg.core.microbatch import MicroBatch
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.anchor.storage import storage_params
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import train_step
    from megatron_empg.parallel.rl_loss import loss_units
    from megatron_empg.trainer.bind.build import bind_loss

    out = {}
    for name in layouts:
        config = load_config(RunConfig, DEMO, BASE + LAYOUTS[name][1])
        model = config.model_config()
        groups = initialize_model_parallel(config.parallel, seed=3)
        try:
            chunks = build_gpt_model(model, config.parallel, params_dtype=torch.bfloat16)
            ddp = wrap_with_ddp(chunks, config.optimizer)
            optimizer = build_optimizer(ddp, config.optimizer)
            if model.lora is not None:
                from megatron_empg.mcore.lora.anchor import AdapterAnchor

                anchor = AdapterAnchor(ddp, optimizer, tau=0.9, period=1)
                anchor_weights = anchor.weight_bytes()
            else:
                dtype = getattr(torch, config.algorithm.anchor.compute_dtype)
                anchor = EmaAnchor.from_configs(
                    model,
                    config.parallel,
                    ddp,
                    optimizer,
                    tau=0.9,
                    period=1,
                    compute_dtype=dtype,
                    fp8_output_layer=config.algorithm.anchor.fp8_output_layer,
                )
                anchor_weights = storage_params(anchor.params)
            ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
            mb = MicroBatch(
                ids,
                ids,
                torch.ones_like(ids, dtype=torch.bool),
                torch.ones(2, 16),
                torch.zeros(2, 16),
                old_logprobs=torch.zeros(2, 16),
            )
            loss, _ = bind_loss(config.algorithm.loss.__class__(), vocab_size=model.vocab_size, topk=0)
            units = functools.partial(loss_units, agg_mode=config.algorithm.loss.agg_mode)  # the router losses' scale
            train_step(
                ddp,
                optimizer,
                build_scheduler(optimizer, config.optimizer),
                [mb, mb],
                loss,
                groups=groups,
                loss_units=units,
            )
            # a mixture of experts chains two optimizers (the dense weights, the experts)
            inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
            state = [
                t
                for inner in inners
                for s in inner.state.values()
                for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0
            ]
            out[name] = {
                "pp_rank": groups.pp_rank,
                "tp_rank": groups.tp_rank,
                "weights": _bytes(p for c in chunks for p in c.parameters()),
                "gradients": _bytes(b.grad_data for d in ddp for b in d.buffers + d.expert_parallel_buffers),
                "main_parameters": _bytes(p for inner in inners for g in inner.param_groups for p in g["params"]),
                "adam": _bytes(state),
                "anchor_weights": anchor_weights,
                "anchor_master": _bytes(t for t, _, _ in anchor.master_shards().values()),
            }
        finally:
            destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    results = {"tp1": run_distributed(_measure, 1, ["tp1"])[0]["tp1"]}
    two = ["tp2", "pp2", "dp2_distopt", "tp2_fp8", "dp2_distopt_fp8", "moe_ep2_distopt", "moe_ep2_fp8", "lora_tp2"]
    for rank_result in run_distributed(_measure, 2, two, timeout=300):
        for name, values in rank_result.items():
            results.setdefault(name, []).append(values)
    return results


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_held_terms_are_the_bytes_of_the_real_objects(measured, name):
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    world, overrides = LAYOUTS[name]
    plan = plan_memory(bind(load_config(RunConfig, DEMO, BASE + overrides), world, check_paths=False))
    ranks = measured[name] if isinstance(measured[name], list) else [measured[name]]
    for values in ranks:
        if values["tp_rank"] != 0:
            continue  # the plan is TP rank 0's (it also holds the replicated norms)
        resident = plan.stages[values["pp_rank"]].resident
        for term in ("weights", "gradients", "main_parameters", "adam", "anchor_weights", "anchor_master"):
            # DDP pads its buffers (and the distributed optimizer's shards) to bucket multiples
            assert resident[term] == pytest.approx(values[term], rel=0.02), (name, term, resident[term], values[term])


# A mixture of experts of some width (16 experts, top-4), routed by the allgather dispatcher at EP 1.
MOE_PROBE = [
    "hidden_size=256",
    "num_attention_heads=4",
    "num_query_groups=2",
    "head_dim=64",
    "num_experts=16",
    "moe_router_topk=4",
    "moe_ffn_hidden_size=128",
    "vocab_size=1024",
]
# (model.moe_experts, the fused weighted SwiGLU): each a term of memory_terms.moe_activations
MOE_EXPERTS = {
    "moe_sequential": ("sequential", False),
    "moe_grouped": ("grouped", False),
    "moe_fused": ("grouped", True),
}


def _probe_model(name: str, layers: int):
    from megatron_empg.config import load_model_config

    if name in MOE_EXPERTS:
        experts = MOE_EXPERTS[name][0]
        return load_model_config("tiny-qwen3-moe", [f"num_layers={layers}", *MOE_PROBE, f"moe_experts={experts}"])
    lora = ["lora.rank=8", "lora.targets=[all-linear]"] if name == "dense_lora" else []
    return load_model_config(
        "deepseek-r1-distill-qwen-1.5b",
        [
            f"num_layers={layers}",
            "vocab_size=1024",
            "bos_token_id=null",
            "eos_token_id=null",
            "pad_token_id=null",
            *lora,
        ],
    )


def _saved_bytes(layers: int, attention: str, seq: int, name: str = "dense") -> int:
    """Bytes of the distinct storages autograd saves in one forward of a padded row of ``seq`` tokens."""
    from megatron_empg.config import ParallelConfig
    from megatron_empg.core.microbatch import MicroBatch
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import _model_forward

    cfg = _probe_model(name, layers)
    parallel = ParallelConfig(moe_token_dispatcher_type="allgather")
    initialize_model_parallel(parallel, seed=0)
    try:
        (model,) = build_gpt_model(cfg, parallel, params_dtype=torch.bfloat16, attention_backend=attention)
        if MOE_EXPERTS.get(name, (None, False))[1]:
            for layer in model.decoder.layers:  # CUDA's fused weighted SwiGLU, uncompiled on the CPU
                layer.mlp.experts.fused_swiglu, layer.mlp.experts.swiglu_backend = True, "eager"
        ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(0))
        storages: dict[int, int] = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # views of them too

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _model_forward(model, MicroBatch(ids, ids))
        return sum(storages.values())
    finally:
        destroy_model_parallel()


def _layer_bytes(rank: int, world_size: int) -> dict:
    out = {
        ("dense", attention, seq): _saved_bytes(2, attention, seq) - _saved_bytes(1, attention, seq)
        for attention in ("sdpa", "unfused")
        for seq in (256, 512)
    }
    for name in (*MOE_EXPERTS, "dense_lora"):
        out[name, "sdpa", 256] = _saved_bytes(2, "sdpa", 256, name) - _saved_bytes(1, "sdpa", 256, name)
    return out


@pytest.mark.dist
@pytest.mark.megatron
def test_layer_activations_are_what_autograd_saves_on_the_cpu():
    from megatron_empg.config import load_model_config
    from megatron_empg.trainer.bind.memory_terms import CPU, layer_activations

    (measured,) = run_distributed(_layer_bytes, 1)
    models = {"dense": load_model_config("deepseek-r1-distill-qwen-1.5b")}
    models.update({name: _probe_model(name, 1) for name in (*MOE_EXPERTS, "dense_lora")})
    for (name, attention, seq), saved in measured.items():
        fused = MOE_EXPERTS.get(name, (None, False))[1]
        linear, quadratic = layer_activations(models[name], 1, attention, fused_swiglu=fused, cal=CPU)
        # what remains is the RoPE table's rows and the position ids: tens of bytes per token
        assert linear * seq + quadratic * seq * seq == pytest.approx(saved, rel=0.02), (name, attention, seq, saved)


def test_plan_is_within_ten_percent_of_every_gpu_measurement():
    from benchmarks.plan_vs_gpu import TOLERANCE, comparisons

    rows = comparisons()
    assert len(rows) >= 3  # the first GPU run's configurations at least
    for row in rows:
        for stage, values in row["stages"].items():
            assert abs(values["ratio"] - 1) <= TOLERANCE, (row["name"], stage, values)


def test_a_plan_over_the_gpu_is_refused_with_the_changes_that_fit():
    from megatron_empg.config import ConfigError
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_fixes import FIELD, with_overrides

    recipe = "recipes/r1_distill_qwen_1.5b_math_ema_pg_16k.yaml"
    config = load_config(RunConfig, recipe, ["train.recompute=none", "train.fused_output_loss=false"])
    with pytest.raises(ConfigError) as error:
        bind(config, 8, check_paths=False, device_bytes=70 * 2**30)
    assert error.value.field == FIELD and "in the update phase" in error.value.reason
    assert "activations" in error.value.reason and "Changes that fit: " in error.value.reason
    fixes = error.value.reason.split("Changes that fit: ")[1].split(". Or set ")[0].split("; ")
    assert any("train.recompute=full" in fix for fix in fixes), fixes
    for fix in fixes:  # each listed change does fit
        overrides = tuple(fix.split(": ", 1)[1].split(" -> ")[0].split(" "))
        bind(with_overrides(config, overrides), 8, check_paths=False, device_bytes=70 * 2**30)
    warn = load_config(RunConfig, recipe, ["train.recompute=none", "train.memory_check=warn"])
    bind(warn, 8, check_paths=False, device_bytes=70 * 2**30)  # a warning, no error


@pytest.mark.parametrize("gib", [None, 40])
def test_empg_plan_prints_and_writes_json(gib):
    recipe = "recipes/r1_distill_qwen_1.5b_math_ema_pg.yaml"
    args = [sys.executable, "-m", "megatron_empg.trainer.cli", "plan", recipe, "--world-size", "8", "--json"]
    if gib:
        args += ["--gpu-memory-gib", str(gib)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["device_bytes"] == (gib or 0) * 2**30 or plan["device_assumed"]
    rank = plan["ranks"][0]
    for key in ("weights_and_optimizer_bytes", "anchor_bytes", "activation_bytes", "peak_bytes"):
        assert rank[key] > 0, key
    assert plan["fits"] == (gib is None) and bool(plan["fixes"]) == (gib is not None)
    text = subprocess.run([a for a in args if a != "--json"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "training rank: peak" in text.stdout and "update" in text.stdout


@pytest.mark.parametrize("staleness", [0, 1])
def test_engines_drawing_ahead_stage_three_updates_per_owner_in_host_memory(staleness):
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    recipe = "recipes/r1_distill_qwen_1.5b_math_ema_pg_one_step_off.yaml"  # 4 training + 4 engine ranks
    config = load_config(RunConfig, recipe, [f"rollout.max_staleness={staleness}", "rollout.tensor_parallel_size=2"])
    components = bind(config, 8, check_paths=False)
    host = plan_memory(components, ranks_per_node=8).host
    # 4 engine ranks at engine TP 2: 2 owners, each up to 3 whole bf16 updates (loading, newest, arriving)
    assert host["staged_weight_updates"] == staleness * 2 * 3 * components.model.num_parameters() * 2


def test_when_no_single_change_fits_a_combination_is_found_and_each_part_is_needed():
    """R1-Distill-Qwen-1.5B's math recipe on 8 x 16 GiB: no single change fits (issue 46), TP 2,
    full recompute and a smaller KV cache together do. Each fix fits when applied, and none of its
    changes can be left out; on 80 GiB nothing needs fixing (the negative control)."""
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_fixes import cheapest_fixes, with_overrides
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    config = load_config(RunConfig, "recipes/r1_distill_qwen_1.5b_math_ema_pg.yaml")
    components = bind(config, 8, check_paths=False)
    assert plan_memory(components, device_bytes=80 * 2**30).fits
    device = 16 * 2**30
    fixes = cheapest_fixes(components, 8, device, bind=bind)
    assert fixes, "no combination found"
    first = fixes[0]
    for part in ("parallel.tensor_model_parallel_size=2", "train.recompute=full", "rollout.gpu_memory_utilization="):
        assert any(o.startswith(part) for o in first.overrides), first
    fitting = plan_memory(bind(with_overrides(config, first.overrides), 8, check_paths=False), device_bytes=device)
    assert fitting.fits and fitting.peak.peak_bytes == first.peak_bytes
    for label in first.label.split(" + "):  # leave one change out: over the GPU again
        kept = [o for o in first.overrides if not _override_of(label, o)]
        fewer = plan_memory(bind(with_overrides(config, tuple(kept)), 8, check_paths=False), device_bytes=device)
        assert not fewer.fits, label


def _override_of(label: str, override: str) -> bool:
    """Whether ``override`` belongs to the change labelled ``label`` (memory_fixes' labels)."""
    keys = {
        "forward passes": ("train.max_tokens_per_forward_microbatch",),
        "logits one chunk": ("train.fused_output_loss",),
        "a smaller KV cache": ("rollout.gpu_memory_utilization",),
        "full recompute": ("train.recompute",),
        "tensor parallelism": ("parallel.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
        "the anchor's master": ("algorithm.anchor.master_on_cpu",),
        "context parallelism": ("parallel.context_parallel_size", "train.max_tokens_per_microbatch"),
    }
    return any(override.startswith(key) for prefix, ks in keys.items() if label.startswith(prefix) for key in ks)
