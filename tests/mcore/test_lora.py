"""LoRA policies (``model.lora``, ``mcore.lora``) on tiny-qwen2, fp32 on CPU.

One spawned rank:
    - adapters with B = 0 give the base model's logits bit for bit (the same seed builds the same
      base); only the adapters require a gradient, and the optimizer holds them alone;
    - with random adapters, the merged weights (``named_weight_shards``: what the weight sync pushes)
      loaded into the plain model give the adapted model's logits; an adapter on k_proj and one on
      up_proj change exactly the k rows of every query group of the fused QKV and the up rows of
      fc1 (Megatron's fused layouts);
    - the anchor over the adapters follows the EMA formula from the optimizer's main parameters,
      and its pass runs the policy's base with the anchor's adapters (the policy's are back after);
    - three RL steps (test_train_step's ``_train``) train the adapters and leave every base weight
      bit-identical.
Two spawned ranks: the same three steps at TP 2, PP 2 and PP 2 x VPP 2 give TP 1's adapters (first-step
gradients tightly, parameters within Adam's bound) and the same untouched base; CP 2 gives one
rank's old pass, metrics and adapters; QKV and proj with adapters at TP 2, with and without
sequence parallelism, give the float64 one-rank layers' outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound
from tests.dist import run_distributed
from tests.mcore.test_train_step import ADAM_EPS, TOL

MODEL = "tiny-qwen2"
LORA = ("lora.rank=4", "lora.alpha=8", "lora.targets=[all-linear]")
EXACT = dict(rtol=0, atol=0)


def _build(overrides, seed: int = 3):
    from megatron.core import tensor_parallel

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.model import build_gpt_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt_model(load_model_config(MODEL, overrides), ParallelConfig(), lora_seed=7)


def _logits(chunks, ids):
    from megatron_empg.mcore.step import causal_mask

    with torch.no_grad():
        return chunks[0](ids, torch.arange(ids.shape[1]).expand_as(ids), causal_mask(ids.shape[1]))


def _randomize_adapters(chunk, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if ".lora." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def _merged_state(chunks) -> dict:
    from megatron_empg.mcore.weights import named_weight_shards

    return {name: tensor.detach().clone() for name, tensor, _ in named_weight_shards(chunks)}


def _module_checks() -> dict:
    from megatron_empg.mcore import weights

    out = {}
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    base, lora = _build(()), _build(LORA)
    out["trainable"] = sorted(n for n, p in lora[0].named_parameters() if p.requires_grad)
    out["frozen_count"] = sum(not p.requires_grad for p in lora[0].parameters())
    out["layers"] = lora[0].config.num_layers
    out["zero_b"] = (_logits(lora, ids), _logits(base, ids))
    _randomize_adapters(lora[0], 11)
    merged = _merged_state(lora)
    out["merged_names"] = sorted(merged) == sorted(n for n, _, _ in weights.named_weight_shards(base))
    adapted = _logits(lora, ids)
    weights.load_full_state_dict(base, merged)
    out["merged"] = (adapted, _logits(base, ids))
    # an adapter on k_proj and one on up_proj: which rows of the fused weights move
    plain = _merged_state(_build(()))
    partial = _build(("lora.rank=4", "lora.targets=[k_proj,up_proj]"))
    _randomize_adapters(partial[0], 12)
    moved = {}
    for name, tensor in _merged_state(partial).items():
        if name.startswith("decoder.layers.0.") and name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
            moved[name.split(".")[-2]] = (tensor != plain[name]).any(dim=1)
    out["moved_rows"] = moved
    out["config"] = {
        k: getattr(partial[0].config, k) for k in ("num_query_groups", "num_attention_heads", "kv_channels")
    }
    out["ffn"] = partial[0].config.ffn_hidden_size
    return out


def _anchor_checks() -> dict:
    """An AdapterAnchor on a LoRA policy with the plain optimizer: the EMA over two updates, and
    the anchor pass against the base with the expected adapters loaded by hand."""
    from megatron_empg.config import OptimizerConfig
    from megatron_empg.mcore.lora.anchor import AdapterAnchor
    from megatron_empg.mcore.optimizer import build_optimizer, wrap_with_ddp

    chunks = _build(LORA)
    ddp = wrap_with_ddp(chunks, OptimizerConfig())
    optimizer = build_optimizer(ddp, OptimizerConfig())
    anchor = AdapterAnchor(ddp, optimizer, tau=0.75, period=1)
    adapters = {n: p for n, p in chunks[0].named_parameters() if ".lora." in n}
    start = {n: p.detach().clone() for n, p in adapters.items()}
    expected = dict(start)
    g = torch.Generator().manual_seed(21)
    for _ in range(2):  # stand-in optimizer steps: new values written into the main (fp32: the params)
        with torch.no_grad():
            for name, param in adapters.items():
                param.add_(torch.randn(param.shape, generator=g))
        anchor.update()
        expected = {n: 0.75 * expected[n] + 0.25 * adapters[n].detach() for n in adapters}
    master = {k.split(".", 1)[1]: v for k, v in anchor.full_master_state().items()}
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    policy_before = {n: p.detach().clone() for n, p in adapters.items()}
    with anchor.forward_models() as models:
        anchor_logits = _logits([models[0].module], ids)
    restored = all(torch.equal(p, policy_before[n]) for n, p in adapters.items())
    by_hand = _build(LORA)
    with torch.no_grad():
        for name, param in by_hand[0].named_parameters():
            if name in expected:
                param.copy_(expected[name])
            else:
                param.copy_(dict(chunks[0].named_parameters())[name])
    return {
        "master": master,
        "expected": expected,
        "anchor_logits": anchor_logits,
        "by_hand_logits": _logits(by_hand, ids),
        "restored": restored,
        "num_updates": anchor.num_updates,
    }


def _lora_state(ddp, optimizer, groups, model_cfg, parallel) -> dict:
    """``_train``'s inspection: adapters and base weights by global name (with TP partitions),
    and the optimizer's parameter count."""
    from megatron_empg.mcore import weights

    adapters, base = {}, {}
    for chunk in ddp:
        module = chunk.module
        offset = weights.layer_offset(module)
        for name, param in module.named_parameters():
            entry = (param.detach().clone(), weights.tp_partition(param))
            (adapters if ".lora." in name else base)[weights.global_name(name, offset)] = entry
    held = sum(len(g["params"]) for g in optimizer.param_groups)
    return {"adapters": adapters, "base": base, "optimizer_params": held}


def _checkpoint_checks(work: str) -> dict:
    """A LoRA run (adapters, Adam, the adapter anchor) steps twice, saves, steps once more; a fresh
    build of the same run loads the checkpoint and steps once: their snapshots, the checkpoint's
    bytes and keys against the model's, and a plain model refused the adapter checkpoint."""
    import math
    import os

    from megatron.core import dist_checkpointing

    from megatron_empg.mcore import checkpoint as ckpt
    from tests.mcore.test_checkpoint import _Run

    saver = _Run(1, False, model=MODEL, model_overrides=LORA)
    try:
        saver.step()
        saver.step()
        path = saver.save(os.path.join(work, "lora"))
        saver.step()
        out = {"continued": saver.snapshot()}
        out["model_bytes"] = sum(p.numel() * p.element_size() for p in saver.chunks[0].parameters())
        out["adapter_bytes"] = sum(
            p.numel() * p.element_size() for n, p in saver.chunks[0].named_parameters() if ".lora." in n
        )
    finally:
        saver.close()
    loader = _Run(1, False, model=MODEL, model_overrides=LORA)
    try:
        loader.load(path)
        loader.step()
        out["resumed"] = loader.snapshot()
        tensors = dist_checkpointing.load_tensors_metadata(str(path))
        out["keys"] = sorted(tensors)
        itemsize = lambda t: torch.empty((), dtype=t.dtype).element_size()  # noqa: E731
        out["tensor_bytes"] = sum(math.prod(t.global_shape) * itemsize(t) for t in tensors.values())
    finally:
        loader.close()
    out["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    out["info"] = ckpt.read_checkpoint_info(path)
    plain = _Run(1, False, model=MODEL)
    try:
        plain.load(path)
        out["plain"] = "loaded"
    except ckpt.CheckpointError as error:
        out["plain"] = str(error)
    finally:
        plain.close()
    return out


def _reference_worker(rank: int, world_size: int, work: str) -> dict:
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from tests.mcore.test_train_step import _train

    initialize_model_parallel(ParallelConfig(), seed=3)
    try:
        out = {"module": _module_checks(), "anchor": _anchor_checks()}
    finally:
        destroy_model_parallel()
    out["train"] = _train(1, 1, False, None, 2, model=MODEL, model_overrides=LORA, inspect=_lora_state)
    out["checkpoint"] = _checkpoint_checks(work)
    return out


def _layouts_worker(rank: int, world_size: int, full: dict) -> dict:
    from tests.mcore.test_train_step import _train

    layouts = (("tp2", 2, 1, {}), ("pp2", 1, 2, {}), ("pp2vpp2", 1, 2, {"virtual_pipeline_model_parallel_size": 2}))
    return {
        name: _train(tp, pp, False, full, 2, model=MODEL, model_overrides=LORA, inspect=_lora_state, **fields)
        for name, tp, pp, fields in layouts
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_distributed(_reference_worker, 1, str(tmp_path_factory.mktemp("lora")), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(reference) -> list[dict]:
    return run_distributed(_layouts_worker, 2, reference["train"]["initial"], timeout=300)


@pytest.mark.megatron
@pytest.mark.dist
def test_zero_adapters_give_the_base_and_only_adapters_train(reference):
    module = reference["module"]
    lora, base = module["zero_b"]
    torch.testing.assert_close(lora, base, **EXACT)
    # layers x (q, k, v, o, gate, up, down) x (A, B); everything else frozen
    adapters = module["layers"] * 7 * 2
    assert len(module["trainable"]) == adapters and all(".lora." in n for n in module["trainable"])
    assert module["frozen_count"] > 0
    assert reference["train"]["inspected"]["optimizer_params"] == adapters


@pytest.mark.megatron
@pytest.mark.dist
def test_merged_weights_give_the_adapted_logits(reference):
    module = reference["module"]
    assert module["merged_names"]  # the base's names, no adapter among them
    adapted, merged = module["merged"]
    assert (adapted - _base_only(reference)).abs().max() > 1e-2  # the adapters do change the logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def _base_only(reference):
    return reference["module"]["zero_b"][1]


@pytest.mark.megatron
@pytest.mark.dist
def test_part_adapters_move_their_rows_of_the_fused_linears(reference):
    module = reference["module"]
    cfg, ffn = module["config"], module["ffn"]
    groups, d = cfg["num_query_groups"], cfg["kv_channels"]
    per_group = cfg["num_attention_heads"] // groups
    qkv = torch.zeros(groups, (per_group + 2) * d, dtype=torch.bool)
    qkv[:, per_group * d : (per_group + 1) * d] = True  # the k rows of every group
    fc1 = torch.zeros(2 * ffn, dtype=torch.bool)
    fc1[ffn:] = True  # the up half
    moved = module["moved_rows"]
    assert torch.equal(moved["linear_qkv"], qkv.flatten())
    assert torch.equal(moved["linear_fc1"], fc1)


@pytest.mark.megatron
@pytest.mark.dist
def test_anchor_over_the_adapters_follows_the_ema(reference):
    anchor = reference["anchor"]
    assert anchor["num_updates"] == 2 and anchor["restored"]
    assert anchor["master"].keys() == anchor["expected"].keys()
    for name, value in anchor["expected"].items():
        torch.testing.assert_close(anchor["master"][name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # the anchor pass: the policy's base with the averaged adapters, as a model built by hand
    torch.testing.assert_close(anchor["anchor_logits"], anchor["by_hand_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.megatron
@pytest.mark.dist
def test_rl_steps_train_the_adapters_and_leave_the_base(reference):
    run = reference["train"]
    initial, state = run["initial"], run["inspected"]
    for name, (value, _) in state["base"].items():
        assert torch.equal(value, initial[name]), name  # bit-identical after three steps
    moved = [n for n, (v, _) in state["adapters"].items() if not torch.equal(v, initial[n])]
    assert len(moved) == len(state["adapters"])  # every adapter trained (A after B left zero)


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.layout
@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2vpp2"])
def test_layouts_equal_tp1(reference, layouts, layout):
    from megatron_empg.mcore.weights import tp_slice

    ref = reference["train"]
    lrs = [h["lr"] for h in ref["history"]]
    seen = set()
    for rank, result in enumerate(r[layout] for r in layouts):
        tp_rank, tp = result["tp_rank"], result["tp"]
        for step, (a, b) in enumerate(zip(result["history"], ref["history"], strict=True)):
            torch.testing.assert_close(a["grad_norm"], b["grad_norm"], **TOL, msg=lambda m: f"step {step}: {m}")
        state = result["inspected"]
        for name, (value, partition) in state["base"].items():
            assert torch.equal(value, tp_slice(ref["initial"][name], partition, tp_rank, tp)), name
        for name, (value, partition) in state["adapters"].items():
            mine = lambda t: tp_slice(t, partition, tp_rank, tp)  # noqa: E731
            ref_grads = [mine(step[name]) for step in ref["grads"]]
            grads = [step[name] for step in result["grads"]]
            assert_grads_close(grads[0], ref_grads[0], f"rank {rank} {name} step 1 gradient")
            reference_value = mine(ref["inspected"]["adapters"][name][0])
            assert_params_within_adam_bound(
                value, reference_value, grads, ref_grads, lrs, eps=ADAM_EPS, what=f"rank {rank} {name}"
            )
            seen.add(name)
    assert seen == ref["inspected"]["adapters"].keys()


@pytest.mark.megatron
@pytest.mark.dist
def test_checkpoint_holds_the_adapters_and_resumes_exactly(reference):
    from tests.mcore.test_checkpoint import LORA_BASE

    result = reference["checkpoint"]
    continued, resumed = result["continued"], result["resumed"]
    for part in ("params", "anchor"):  # same layout, same process: bit for bit
        assert continued[part].keys() == resumed[part].keys()
        for name, value in continued[part].items():
            a = value[0] if part == "params" else value
            b = resumed[part][name][0] if part == "params" else resumed[part][name]
            assert torch.equal(a, b), f"{part} {name}"
    assert resumed["losses"][-1] == continued["losses"][-1] and resumed["lr"] == continued["lr"]
    assert result["info"]["lora_base"] == LORA_BASE
    model_keys = [k for k in result["keys"] if not k.startswith(("optimizer.", "anchor", "rng_state"))]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys[:4]  # no base weight saved
    # the tensors: the adapters, Adam's two moments and the anchor's master, nothing else (fp32)
    assert result["tensor_bytes"] == 4 * result["adapter_bytes"]
    assert result["bytes"] < result["model_bytes"]  # with the per-shard overhead of tiny tensors
    assert "holds LoRA adapters only" in result["plain"]  # a model without adapters is refused


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.layout
def test_context_parallel_equals_one_rank():
    """CP 2 against one rank (test_cp_training's run: the same packed rows, each CP rank its share):
    the old pass, three steps' metrics and grad norms, the adapters within Adam's bound."""
    from megatron_empg.config import ParallelConfig
    from tests.trainer import test_cp_training as cp

    cases = [("token-mean", "k3")]
    reference = run_distributed(cp._train, 1, ParallelConfig(), cases, None, LORA, timeout=300)[0]
    layout = ParallelConfig(context_parallel_size=cp.CP)
    per_rank = run_distributed(cp._train, 2, layout, cases, reference["initial"], LORA, timeout=300)
    ref = reference[cases[0]]
    assert ref["params"] and all(".lora." in n for n in ref["params"])  # the adapters trained, alone
    for rank, results in enumerate(per_rank):
        ours = results[cases[0]]
        for got, want, mask in zip(ours["old"], ref["old"], ref["masks"], strict=True):
            torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
        for step in range(cp.STEPS):
            assert ours["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], rel=1e-5), (rank, step)
            assert ours["metrics"][step]["loss"] == pytest.approx(ref["metrics"][step]["loss"], rel=1e-5, abs=1e-6)
        cp._assert_params(ours, ref, 1, 1, f"cp2 rank {rank}")


def test_base_fingerprint_tells_bases_apart(tmp_path):
    from megatron_empg.mcore.lora.base import base_fingerprint, base_record

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 10_000)  # past the 1 MiB pieces
    same = base_fingerprint(base)
    assert base_fingerprint(base) == same and base_record(base)["fingerprint"] == same
    with open(base / "model.safetensors", "r+b") as f:  # one byte in the last MiB
        f.seek(2_000_000)
        f.write(b"\xff")
    assert base_fingerprint(base) != same
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 10_000)
    assert base_fingerprint(base) == same  # restored
    (base / "extra.safetensors").write_bytes(b"x")
    assert base_fingerprint(base) != same  # a shard added


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model_overrides=[lora.rank=0]"], "model.lora.rank"),
        (['model_overrides=["lora.targets=[q_proj,qkv]"]'], "model.lora.targets"),
        (["model=tiny-qwen3-moe", 'model_overrides=["lora.targets=[up_proj]"]'], "model.lora.targets"),
        (
            ["model_overrides=[lora.rank=4]", "optimizer.use_distributed_optimizer=true"],
            "optimizer.use_distributed_optimizer",
        ),
        (["model_overrides=[lora.rank=4]", "algorithm.anchor.master_on_cpu=true"], "algorithm.anchor.master_on_cpu"),
        (["model_overrides=[lora.rank=4]", "checkpoint.init_from=null"], "checkpoint.init_from"),
        (["weight_sync.lora_mode=adapter"], "weight_sync.lora_mode"),  # no adapters to push
        (
            ["model_overrides=[lora.rank=4]", "weight_sync.lora_mode=adapter", "rollout.engine=hf"],
            "weight_sync.lora_mode",
        ),
        (["model_overrides=[lora.rank=4]", "weight_sync.lora_mode=bogus"], "weight_sync.lora_mode"),
        (["model_overrides=[lora.rank=4]", "weight_sync.lora_mode=adapter"], None),  # accepted
        (["model_overrides=[lora.rank=4]"], None),  # the control: accepted
    ],
)
def test_bind_checks_lora_settings_naming_the_field(tmp_path, overrides, field):
    from megatron_empg.config import ConfigError, RunConfig, load_config
    from megatron_empg.trainer.bind.build import bind
    from tests.trainer.demo_runs import DEMO_RECIPE

    def bound():
        base = [f"checkpoint.init_from={tmp_path}", f"tokenizer={tmp_path}", f"model={MODEL}"]
        return bind(load_config(RunConfig, DEMO_RECIPE, [*base, *overrides]), world_size=1, check_paths=False)

    if field is None:
        assert bound().model.lora.rank == 4
        return
    with pytest.raises(ConfigError) as error:
        bound()
    assert error.value.field == field


def test_adapter_sync_refuses_partial_rollouts(tmp_path):
    from megatron_empg.config import ConfigError, RunConfig, load_config
    from megatron_empg.trainer.bind.build import _check_lora_sync
    from tests.trainer.demo_runs import DEMO_RECIPE

    base = [f"model={MODEL}", "model_overrides=[lora.rank=4]", "weight_sync.lora_mode=adapter"]
    partial = load_config(
        RunConfig,
        DEMO_RECIPE,
        [
            *base,
            "rollout.partial=true",
            "rollout.max_staleness=1",
            "rollout.placement=disaggregated",
            "rollout.engine_ranks=1",
        ],
    )
    with pytest.raises(ConfigError) as error:
        _check_lora_sync(partial, partial.model_config())
    assert error.value.field == "weight_sync.lora_mode" and "partial" in error.value.reason
    whole = load_config(RunConfig, DEMO_RECIPE, base)
    _check_lora_sync(whole, whole.model_config())  # the control


# --------------------------------------------------------------------------------------------
# Sequence parallelism, at the layers (the trainer's needs the TE spec, which takes no adapters).


def _sp_worker(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    """QKV (column-parallel) and proj (row-parallel) with adapters at TP 2, their weights the
    TP shards of full ones drawn on every rank alike; forward and backward of a fixed input. The
    replicated matrices' gradients summed over TP where they are marked ``sequence_parallel`` (as
    Megatron's ``finalize_model_grads`` does). Returns the full outputs and every full gradient."""
    import torch.distributed as dist

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear
    from megatron_empg.mcore.model import transformer_config
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.weights import tp_partition, tp_slice

    model = load_model_config(MODEL, LORA)
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    groups = initialize_model_parallel(parallel, seed=3)
    try:
        config = transformer_config(
            model,
            parallel,
            params_dtype=torch.float32,
            use_cpu_initialization=True,
            sequence_parallel=sequence_parallel,
        )
        h, q = model.hidden_size, model.num_attention_heads * model.kv_channels
        out_qkv = q + 2 * model.num_query_groups * model.kv_channels
        common = dict(config=config, init_method=torch.nn.init.zeros_, bias=False, lora=model.lora)
        targets = model.lora.resolved_targets(moe=False)
        qkv = LoraColumnParallelLinear(h, out_qkv, gather_output=False, role="qkv", targets=targets, **common)
        proj = LoraRowParallelLinear(
            q, h, input_is_parallel=True, skip_bias_add=True, role="proj", targets=targets, **common
        )
        g = torch.Generator().manual_seed(7)
        full = {}
        for prefix, layer in (("qkv", qkv), ("proj", proj)):
            for name, param in layer.named_parameters():
                shape = list(param.shape)
                partition = tp_partition(param)
                if partition is not None:
                    shape[partition[0]] *= groups.tp_size
                full[f"{prefix}.{name}"] = torch.randn(shape, generator=g) * 0.2
                with torch.no_grad():
                    param.copy_(tp_slice(full[f"{prefix}.{name}"], partition, groups.tp_rank, groups.tp_size))
        x = torch.randn(8, 1, h, generator=g)
        grad_out = torch.randn(8, 1, h, generator=g)
        local = x.chunk(groups.tp_size)[groups.tp_rank] if sequence_parallel else x
        local = local.clone().requires_grad_()
        a, _ = qkv(local)
        attn = a[..., : q // groups.tp_size].contiguous()  # this rank's heads' q part stands in for attention
        y, _ = proj(attn)
        y_grad = grad_out.chunk(groups.tp_size)[groups.tp_rank] if sequence_parallel else grad_out
        y.backward(y_grad)
        grads = {}
        for prefix, layer in (("qkv", qkv), ("proj", proj)):
            for name, param in layer.named_parameters():
                grad = param.grad.clone()
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(grad, group=groups.tp_group)
                partition = tp_partition(param)
                if partition is not None:
                    parts = [torch.empty_like(grad) for _ in range(groups.tp_size)]
                    dist.all_gather(parts, grad, group=groups.tp_group)
                    grad = torch.cat(parts, dim=partition[0])
                grads[f"{prefix}.{name}"] = grad
        if sequence_parallel:
            parts = [torch.empty_like(y) for _ in range(groups.tp_size)]
            dist.all_gather(parts, y.detach(), group=groups.tp_group)
            y = torch.cat(parts)
        return {"y": y.detach(), "grads": grads, "full": full, "x": x, "grad_out": grad_out}
    finally:
        destroy_model_parallel()


def _sp_reference(result: dict, tp: int) -> dict:
    """The same two layers whole, in float64 (TP 1): each rank's q part as the attention stand-in."""
    from megatron_empg.config import load_model_config

    model = load_model_config(MODEL, LORA)
    full = {k: v.double().requires_grad_() for k, v in result["full"].items()}
    x = result["x"].double()
    groups, scale = model.num_query_groups, model.lora.scale

    def lora(prefix, target, inp):
        return inp @ full[f"{prefix}.lora.{target}.lora_A"].t() @ full[f"{prefix}.lora.{target}.lora_B"].t()

    fused = x @ full["qkv.weight"].t()
    q_rows = full["qkv.lora.q_proj.lora_B"].shape[0]
    delta_q = lora("qkv", "q_proj", x).reshape(8, 1, groups, -1)
    delta_k = lora("qkv", "k_proj", x).reshape(8, 1, groups, -1)
    delta_v = lora("qkv", "v_proj", x).reshape(8, 1, groups, -1)
    fused = fused + scale * torch.cat((delta_q, delta_k, delta_v), -1).reshape(8, 1, -1)
    # every rank's first q // tp columns of its own QKV shard: the rows of its query groups
    shard = fused.shape[-1] // tp
    attn = torch.cat([fused[..., r * shard : r * shard + q_rows // tp] for r in range(tp)], dim=-1)
    y = attn @ full["proj.weight"].t() + scale * lora("proj", "o_proj", attn)
    y.backward(result["grad_out"].double())
    return {"y": y.detach().float(), "grads": {k: v.grad.float() for k, v in full.items()}}


def _sp_both(rank: int, world_size: int) -> dict:
    return {sp: _sp_worker(rank, world_size, sp) for sp in (False, True)}


@pytest.mark.megatron
@pytest.mark.dist
def test_adapted_linears_at_tp2_with_and_without_sequence_parallelism():
    per_rank = run_distributed(_sp_both, 2, timeout=240)
    for sp in (False, True):
        reference = _sp_reference(per_rank[0][sp], 2)
        for rank, results in enumerate(per_rank):
            result, what = results[sp], f"{'sp' if sp else 'tp2'} rank {rank}"
            torch.testing.assert_close(result["y"], reference["y"], rtol=1e-5, atol=1e-5, msg=f"{what} output")
            for name, grad in reference["grads"].items():
                torch.testing.assert_close(
                    result["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {name}: {m}"
                )
