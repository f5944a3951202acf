"""``GroupedExperts`` (``model.moe_experts: grouped``, ``mcore.moe.grouped``) against Megatron's
``SequentialMLP`` on tiny-qwen3-moe (8 experts, top-2), fp32 on CPU.

In this process (no Megatron): the grouped GEMM (``mcore.moe.gemm``) on both paths against an
independent per-expert loop, with empty groups; the grouped_mm path, the offsets and the fused
SwiGLU read nothing on the host; the fused SwiGLU equals the unfused one and compiles once for
every token count; ``model.moe_experts`` resolves (and refuses) as documented and ``empg check``
says which implementation runs and why.

One spawned rank (EP 1):
    - both builds draw the same initial weights; the experts module alone (tokens sorted by expert,
      experts with no tokens) and the whole model (padded rows, a packed row) give bit-equal
      outputs and gradients on the per-expert fallback path, and equal ones (1e-6) through torch's
      grouped_mm and the fused SwiGLU; the grouped module's forward and backward read nothing on
      the host on the grouped_mm path, nor does the whole MoE layer (``GroupedMoELayer`` with
      ``LocalTokenDispatcher``: no scalar read, no op of a data-dependent shape), while Megatron's
      dispatcher with SequentialMLP does; Megatron's allgather setting gives the same model;
    - the checkpoint entries (``sharded_state_dict``, factories built) and the weight sync's
      per-expert tensors (``named_weight_shards``) are those of SequentialMLP;
    - three RL steps (test_train_step's ``_train``) give sequential's losses, metrics, grad norms
      and parameters;
    - a grouped checkpoint (Adam state, scheduler, EMA anchor) loads into sequential and continues
      as the grouped run does, and back (with the distributed optimizer);
    - HF -> Megatron checkpoint -> grouped model (transformers' logits) -> its checkpoint -> HF:
      every tensor bit-identical.
Two spawned ranks: at EP 2 and at expert-TP 2 the grouped model gives EP 1's logits and gradients
and SequentialMLP's checkpoint entries at that layout; a grouped EP 2 checkpoint loads into
sequential at EP 1 and continues alike.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_empg.mcore.moe import gemm
from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound
from tests.dist import run_distributed
from tests.mcore.test_train_step import ADAM_EPS, _assert_same_params

MODEL = "tiny-qwen3-moe"
GROUPED, SEQUENTIAL = ("moe_experts=grouped",), ("moe_experts=sequential",)
EXACT = dict(rtol=0, atol=0)
CLOSE = dict(rtol=1e-6, atol=1e-6)  # grouped_mm / the fused SwiGLU: other summation orders
TOL = dict(rtol=1e-5, atol=1e-5)  # other layouts, as tests/mcore/test_train_step.py
# Parameters after Adam steps: within Adam's bound for the two runs' applied gradients
# (tests/adam_bound.py; docs/testing.md, "Tolerances after an optimizer step").
TOKENS_PER_EXPERT = [3, 0, 2, 0, 4, 1, 0, 2]  # three experts get no token


# --------------------------------------------------------------------------------------------
# The arithmetic, in this process.


def _loop_reference(x, weight, counts):
    """An independent per-expert loop: rows of expert g times weight[g].T."""
    outs, start = [], 0
    for g, n in enumerate(counts):
        outs.append(x[start : start + n] @ weight[g].T)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 6, 4], [0, 0, 13, 0], [0, 0, 0, 0]], ids=["empty_group", "one", "none"])
def test_both_gemm_paths_equal_a_per_expert_loop(counts):
    g = torch.Generator().manual_seed(0)
    m = sum(counts)
    x, w = torch.randn(m, 8, generator=g), torch.randn(4, 12, 8, generator=g)
    grad = torch.randn(m, 12, generator=g)
    x0, w0 = x.clone().requires_grad_(), w.clone().requires_grad_()
    _loop_reference(x0, w0, counts).backward(grad)
    offsets = gemm.group_offsets(torch.tensor(counts), x.device)
    assert offsets.dtype == torch.int32 and offsets.tolist() == torch.tensor(counts).cumsum(0).tolist()
    for path, tol in (("per_group", EXACT), ("grouped_mm", CLOSE)):
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = gemm.grouped_linear(x1, w1, offsets, path=path)
        y.backward(grad)
        torch.testing.assert_close(y, _loop_reference(x, w, counts), **tol, msg=lambda e: f"{path}: {e}")
        torch.testing.assert_close(x1.grad, x0.grad, **tol)
        torch.testing.assert_close(w1.grad, w0.grad, **tol)  # an empty group's gradient: zeros
    assert gemm.gemm_path(x, w) == "per_group"  # CPU: grouped_mm's fast path is CUDA bf16
    assert gemm.grouped_mm_unsupported(torch.randn(4, 6), torch.randn(2, 3, 6)) is not None  # 24-byte rows


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


def _refuse(*_args, **_kwargs):
    raise AssertionError("a host read of a tensor's values")


def _refuse_host_reads(monkeypatch) -> None:
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, _refuse)


def test_grouped_mm_path_reads_nothing_on_the_host(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w1, w2 = torch.randn(8, 16, 8, generator=g, requires_grad=True), torch.randn(8, 8, 8, generator=g)
    w2.requires_grad_()
    probs = torch.rand(12, generator=g, requires_grad=True)
    tokens = torch.tensor(TOKENS_PER_EXPERT)
    with monkeypatch.context() as patch:
        _refuse_host_reads(patch)
        offsets = gemm.group_offsets(tokens, x.device)
        fc1 = gemm.grouped_linear(x, w1, offsets, path="grouped_mm")
        hidden = gemm.weighted_swiglu(fc1, probs, fused=True, backend="eager")  # compiled: the test below
        y = gemm.grouped_linear(hidden, w2, offsets, path="grouped_mm")
        y.backward(torch.ones_like(y))
        with pytest.raises(AssertionError, match="host read"):  # the check sees the fallback's read
            gemm.grouped_linear(x, w1, offsets, path="per_group")
    assert all(t.grad is not None for t in (x, w1, w2, probs))


def test_fused_weighted_swiglu_equals_the_unfused_and_compiles_once():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(2)
    for tokens in (5, 17, 0, 1, 33):  # 0 and 1 would specialize a backed size
        fc1 = torch.randn(tokens, 16, generator=g, requires_grad=True)
        probs = torch.rand(tokens, generator=g, requires_grad=True)
        grad = torch.randn(tokens, 8, generator=g)
        ref = gemm.weighted_swiglu(fc1, probs, fused=False)
        ref_grads = torch.autograd.grad(ref, (fc1, probs), grad)
        out = gemm.weighted_swiglu(fc1, probs, fused=True, backend="aot_eager")
        grads = torch.autograd.grad(out, (fc1, probs), grad)
        torch.testing.assert_close(out, ref, **CLOSE)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, **CLOSE)
    assert counters["stats"]["unique_graphs"] - before == 2  # one forward, one backward graph


def test_moe_experts_resolves_as_documented(monkeypatch):
    from megatron_empg.config import ConfigError, load_model_config
    from megatron_empg.mcore.attention_backends import AttentionChoice
    from megatron_empg.mcore.moe import backends

    assert load_model_config(MODEL).moe_experts == "auto"
    assert load_model_config(MODEL, GROUPED).moe_experts == "grouped"
    sdpa, te = AttentionChoice("sdpa", "configured"), AttentionChoice("te", "configured")
    monkeypatch.setattr(backends, "te_import_error", lambda: "ModuleNotFoundError: No module named 'x'")
    assert backends.resolve_moe_experts("auto", sdpa) == backends.ExpertsChoice(
        "grouped", "auto: Transformer Engine is not importable"
    )
    assert backends.resolve_moe_experts("sequential", sdpa).describe() == "sequential (configured)"
    with pytest.raises(ConfigError) as error:
        backends.resolve_moe_experts("te", sdpa)
    assert error.value.field == "model.moe_experts" and "\n" not in str(error.value)
    assert "te needs Transformer Engine, which does not import here" in str(error.value)
    with pytest.raises(ConfigError, match="model.moe_experts: unknown name 'bogus'"):
        backends.resolve_moe_experts("bogus", sdpa)
    monkeypatch.setattr(backends, "te_import_error", lambda: None)  # a machine with TE
    assert backends.resolve_moe_experts("auto", te).name == "te"
    assert backends.resolve_moe_experts("auto", sdpa) == backends.ExpertsChoice("grouped", "auto: attention is sdpa")
    with pytest.raises(ConfigError, match="te needs Transformer Engine's layer spec"):
        backends.resolve_moe_experts("te", sdpa)


def test_bind_and_empg_check_say_which_experts_run(tmp_path):
    from megatron_empg.config import ConfigError, RunConfig, load_config
    from megatron_empg.mcore.attention_backends import te_import_error
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.cli import _describe
    from tests.trainer.demo_runs import DEMO_RECIPE

    if te_import_error() is None:
        pytest.skip("Transformer Engine imports here: auto is te")

    def bound(*overrides):
        base = ["checkpoint.init_from=null", f"tokenizer={tmp_path}", f"model={MODEL}"]
        return bind(load_config(RunConfig, DEMO_RECIPE, [*base, *overrides]), world_size=1, check_paths=False)

    auto = bound()
    assert auto.model.moe_experts == "grouped"  # what every builder of the run uses
    line = _describe(auto).splitlines()[-1]
    assert line.startswith("experts grouped (auto: Transformer Engine is not importable); on a GPU: ")
    assert bound("model_overrides=[moe_experts=sequential]").experts.describe() == "sequential (configured)"
    with pytest.raises(ConfigError) as error:
        bound("model_overrides=[moe_experts=te]")
    assert error.value.field == "model.moe_experts"
    dense = bind(
        load_config(RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", f"tokenizer={tmp_path}"]),
        world_size=1,
        check_paths=False,
    )
    assert dense.experts is None and "experts" not in _describe(dense)


# --------------------------------------------------------------------------------------------
# Megatron, in spawned ranks.


def _expert_tensors(chunks, what: str = "param") -> dict[str, tuple[torch.Tensor, tuple | None]]:
    """Global per-expert name -> (a clone of the parameter or its gradient, TP partition): the
    weight sync's names (``named_weight_shards``), a stacked weight row by row."""
    from megatron_empg.mcore import weights

    out = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        offset, experts = weights.layer_offset(module), weights.expert_offset(module)
        for name, param in module.named_parameters():
            tensor = param.detach() if what == "param" else param.grad
            for local, view, partition in weights.split_experts(name, tensor, weights.tp_partition(param)):
                out[weights.global_name(local, offset, experts)] = (view.clone(), partition)
    return out


def _sharded_entries(chunk) -> list[tuple]:
    """Every checkpoint entry of ``chunk`` (factories built): (key, global shape, global offset,
    replica id, data or None), sorted."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    entries = []
    for value in nested_values(chunk.sharded_state_dict()):
        built = value.build() if isinstance(value, ShardedTensorFactory) else value
        for item in built if isinstance(built, list) else [built]:
            assert isinstance(item, ShardedTensor | ShardedObject), type(item)
            data = item.data.detach().clone() if isinstance(item, ShardedTensor) else None
            entries.append((item.key, tuple(item.global_shape), tuple(item.global_offset), item.replica_id, data))
    return sorted(entries, key=lambda e: e[:3])


def _entry_mismatches(grouped: list[tuple], sequential: list[tuple]) -> list[str]:
    if len(grouped) != len(sequential):
        return [f"{len(grouped)} entries against {len(sequential)}"]
    bad = []
    for g, s in zip(grouped, sequential, strict=True):
        same_data = (g[4] is None and s[4] is None) or (
            g[4] is not None and s[4] is not None and torch.equal(g[4], s[4])
        )
        if g[:4] != s[:4] or not same_data:
            bad.append(f"{g[:4]} != {s[:4]} (data equal: {same_data})")
    return bad


def _models(parallel, seed: int = 3):
    """(grouped, sequential) chunks of tiny-qwen3-moe at ``parallel``, built from the same seed."""
    from megatron.core import tensor_parallel

    from megatron_empg.config import load_model_config
    from megatron_empg.mcore.model import build_gpt_model

    out = []
    for overrides in (GROUPED, SEQUENTIAL):
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        out.append(build_gpt_model(load_model_config(MODEL, overrides), parallel))
    return out


def _batches(vocab: int) -> dict:
    """A padded micro-batch (two rows, the second right-padded) and a packed row of three
    sequences and padding, with fixed output-gradient weights."""
    from megatron_empg.core.microbatch import MicroBatch

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (2, 16), generator=g)
    ids[1, 11:] = 0  # padding
    lengths = [5, 7, 3, 1]  # the last segment is the padding
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed_ids = torch.randint(1, vocab, (1, 16), generator=g)
    packed_ids[0, 15:] = 0
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return {
        "padded": MicroBatch(ids, ids),
        "packed": MicroBatch(packed_ids, packed_ids, position_ids=positions, cu_seqlens=cu, max_seqlen=max(lengths)),
        "weights": torch.randn(2, 16, vocab, generator=g),
    }


def _forward_backward(chunks, batch, weights, vocab: int) -> dict:
    """Logits of ``batch`` and every gradient of sum(logits x weights) (per-expert names)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.step import _model_forward

    chunk = chunks[0]
    chunk.zero_grad(set_to_none=True)
    logits = mcore_weights.gather_logits(_model_forward(chunk, batch), vocab)
    (logits * weights[: logits.shape[0], : logits.shape[1]]).sum().backward()
    # a backward outside Megatron's schedule leaves the aux loss's scale a 0-d tensor, which the
    # schedule's later set_loss_scale cannot copy its [1] scale into
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    return {"logits": logits.detach().clone(), "grads": _expert_tensors(chunks, "grad")}


def _experts_module_checks(grouped, sequential) -> dict:
    """Layer 0's experts alone: tokens sorted by expert, three experts without tokens."""
    g = torch.Generator().manual_seed(9)
    tokens = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(int(tokens.sum()), grouped.config.hidden_size, generator=g)
    probs, grad = torch.rand(x.shape[0], generator=g), torch.randn(x.shape, generator=g)

    def run(module):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        out, bias = module(xi, tokens, pi)
        out.backward(grad)
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        return {"out": out.detach(), "x": xi.grad, "probs": pi.grad, "grads": grads, "bias": bias}

    seq = run(sequential)
    seq_grads = {}
    for j in range(len(TOKENS_PER_EXPERT)):
        for fc in ("linear_fc1", "linear_fc2"):
            seq_grads[(fc, j)] = seq["grads"][f"local_experts.{j}.{fc}.weight"]
    out = {"sequential": seq, "sequential_grads": seq_grads}
    for variant, path, fused in (("fallback", "per_group", False), ("grouped_mm", "grouped_mm", True)):
        grouped.gemm_path, grouped.fused_swiglu, grouped.swiglu_backend = path, fused, "eager"
        res = run(grouped)
        res["grads"] = {(fc, j): res["grads"][f"{fc}.weight"][j] for (fc, j) in seq_grads}
        out[variant] = res
    # no host read in the grouped module's forward and backward on the grouped_mm path
    import _pytest.monkeypatch

    patch = _pytest.monkeypatch.MonkeyPatch()
    try:
        _refuse_host_reads(patch)
        out["no_host_read"] = run(grouped)["out"].shape
    finally:
        patch.undo()
    grouped.gemm_path, grouped.fused_swiglu, grouped.swiglu_backend = "auto", False, None
    return out


class _DataDependentOps(TorchDispatchMode):
    """Records the ATen ops whose output shape or value the host must read on CUDA (a sync each):
    a scalar read, nonzero and its kin, indexing by a mask."""

    OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in self.OPS:
            self.seen.append(name)
        elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append("index by a mask")
        return func(*args, **(kwargs or {}))


def _layer_checks(grouped, sequential) -> dict:
    """Layer 0's whole MoE layer (router, dispatch, experts, combine) forward and backward with
    every host read refused (on CUDA, ``.cpu()`` of a device tensor is one too) and the ops of a
    data-dependent shape recorded: the grouped layer's dispatcher, what each layer read."""
    import _pytest.monkeypatch

    out = {}
    g = torch.Generator().manual_seed(13)
    for name, layer in (("grouped", grouped), ("sequential", sequential)):
        x = torch.randn(16, 1, layer.config.hidden_size, generator=g).requires_grad_()
        if name == "grouped":
            layer.experts.gemm_path, layer.experts.swiglu_backend = "grouped_mm", "eager"
        patch, ops = _pytest.monkeypatch.MonkeyPatch(), _DataDependentOps()
        try:
            for method in (*HOST_READS, "cpu"):
                patch.setattr(torch.Tensor, method, _refuse)
            with ops:
                y, _ = layer(x)
                y.sum().backward()
            out[name] = ops.seen or "no host read"
        except AssertionError as error:
            out[name] = str(error)
        finally:
            patch.undo()
            layer.experts.gemm_path, layer.experts.swiglu_backend = "auto", None
    with _DataDependentOps() as control:  # the recorder sees a mask index
        x[x > 0]
    out["control"] = control.seen
    out["layer"] = type(grouped).__name__
    out["dispatcher"] = type(grouped.token_dispatcher).__name__
    return out


def _ckpt_snapshot(run) -> dict:
    return {
        "params": _expert_tensors(run.chunks),
        "anchor": _expert_tensors(run.anchor.models),
        "lr": run.optimizer.param_groups[0]["lr"],
        "steps": run.scheduler.num_steps,
        "grads": list(run.grads),  # per step, what Adam applied (tests.adam_bound)
        "lrs": list(run.lrs),
    }


def _assert_step_after_load(stepped: dict, continued: dict, what: str) -> None:
    """One step after the same loaded state: the loader's parameters and anchor within Adam's
    bound for the two runs' gradients of that step (the history before it loaded exactly); the
    anchor's EMA mixes the shared old anchor with the parameter, which moves it by at most as
    much. ``stepped``: the loader's snapshot (one step), ``continued``: the saver's."""
    (step,) = stepped["grads"]
    for name, (value, _) in continued["params"].items():
        history = [g[name] for g in continued["grads"]]
        grads = history[:-1] + [step[name]]
        assert_grads_close(grads[-1], history[-1], f"{what} gradient of {name}")
        for part in ("params", "anchor"):
            assert_params_within_adam_bound(
                stepped[part][name][0],
                continued[part][name][0],
                grads,
                history,
                continued["lrs"],
                eps=ADAM_EPS,
                what=f"{what} {part} {name}",
            )


def _checkpoint_swap(root: str, save_as, load_as, distopt: bool, fields: dict, load_fields: dict) -> dict:
    """A run of ``save_as`` steps twice, saves, steps once more; a run of ``load_as`` loads the
    checkpoint and steps once: their parameters, anchors and schedules at each point."""
    from tests.mcore.test_checkpoint import _Run

    saver = _Run(1, distopt, model=MODEL, model_overrides=save_as, **fields)
    try:
        saver.step()
        saver.step()
        path = saver.save(root)
        saved = _ckpt_snapshot(saver)
        saver.step()
        continued = _ckpt_snapshot(saver)
    finally:
        saver.close()
    loader = _Run(1, distopt, model=MODEL, model_overrides=load_as, **load_fields)
    try:
        loader.load(path)
        loaded = _ckpt_snapshot(loader)
        loader.step()
        stepped = _ckpt_snapshot(loader)
    finally:
        loader.close()
    return {"saved": saved, "continued": continued, "loaded": loaded, "stepped": stepped}


def _hf_round_trip(work: Path) -> dict:
    """HF -> Megatron checkpoint -> a grouped model (logits) -> its checkpoint -> HF."""
    from safetensors.torch import load_file

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import causal_mask
    from tests.tools.test_convert import QUIET, _run_tool
    from tools.make_tiny_model import tiny_hf_model

    cfg = load_model_config(MODEL, GROUPED)
    hf = tiny_hf_model(cfg, seed=3)
    hf.save_pretrained(work / "hf")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        hf_logits = hf(ids).logits
    to_megatron = _run_tool(
        "convert_hf_to_megatron", [str(work / "hf"), str(work / "mg"), "--tp", "1", "--pp", "1", *QUIET]
    )
    groups = initialize_model_parallel(ParallelConfig(), seed=7)
    try:
        chunks = build_gpt_model(cfg, ParallelConfig())
        kind = type(chunks[0].decoder.layers[0].mlp.experts).__name__
        ckpt.load_checkpoint(work / "mg", ckpt.CheckpointParts(chunks), groups)
        with torch.no_grad():
            logits = chunks[0](ids, torch.arange(16).expand(2, 16), causal_mask(16))
            logits = mcore_weights.gather_logits(logits, cfg.vocab_size)
        ckpt.save_checkpoint(
            work / "trained",
            ckpt.TrainState(0),
            ckpt.CheckpointParts(chunks),
            groups,
            model=ckpt.ModelMetadata(config=cfg, hf_assets=work / "hf"),
        )
    finally:
        destroy_model_parallel()
    back = _run_tool("convert_megatron_to_hf", [str(work / "trained"), str(work / "back"), *QUIET])
    return {
        "tools": (to_megatron, back),
        "kind": kind,
        "logits": logits,
        "hf_logits": hf_logits,
        "original": load_file(work / "hf" / "model.safetensors"),
        "back": load_file(work / "back" / "model.safetensors"),
    }


def _ep1_worker(rank: int, world_size: int, work: str) -> dict:
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from tests.mcore.test_train_step import _train

    work = Path(work)
    cfg = load_model_config(MODEL)
    parallel = ParallelConfig()
    out: dict = {}
    initialize_model_parallel(parallel, seed=3)
    try:
        grouped, sequential = _models(parallel)
        out["kinds"] = [type(m[0].decoder.layers[0].mlp.experts).__name__ for m in (grouped, sequential)]
        out["init"] = [_expert_tensors(m) for m in (grouped, sequential)]
        out["full"] = {n: t for n, (t, _) in out["init"][1].items()}  # the per-expert full state dict
        out["entries"] = _entry_mismatches(_sharded_entries(grouped[0]), _sharded_entries(sequential[0]))
        shards = [
            [(n, t.detach().clone(), p) for n, t, p in mcore_weights.named_weight_shards(m)]
            for m in (grouped, sequential)
        ]
        out["shards"] = shards
        batches = _batches(cfg.vocab_size)
        for kind in ("padded", "packed"):
            out[kind] = [
                _forward_backward(m, batches[kind], batches["weights"], cfg.vocab_size) for m in (grouped, sequential)
            ]
        out["module"] = _experts_module_checks(
            grouped[0].decoder.layers[0].mlp.experts, sequential[0].decoder.layers[0].mlp.experts
        )
        out["layer"] = _layer_checks(grouped[0].decoder.layers[0].mlp, sequential[0].decoder.layers[0].mlp)
        # the allgather dispatcher's setting at EP 1: grouped experts route locally all the same
        allgather = _models(ParallelConfig(moe_token_dispatcher_type="allgather"))
        out["allgather"] = {
            "dispatchers": [type(m[0].decoder.layers[0].mlp.token_dispatcher).__name__ for m in allgather],
            "padded": [_forward_backward(m, batches["padded"], batches["weights"], cfg.vocab_size) for m in allgather],
        }
    finally:
        destroy_model_parallel()
    full = out["full"]
    out["train"] = [_train(1, 1, False, full, 4, model=MODEL, model_overrides=o) for o in (GROUPED, SEQUENTIAL)]
    out["g2s"] = _checkpoint_swap(str(work / "g2s"), GROUPED, SEQUENTIAL, False, {}, {})
    out["s2g"] = _checkpoint_swap(str(work / "s2g"), SEQUENTIAL, GROUPED, True, {}, {})
    out["hf"] = _hf_round_trip(work)
    return out


LAYOUTS = [("ep2", dict(expert_model_parallel_size=2)), ("etp2", dict(expert_tensor_parallel_size=2))]


def _ep2_worker(rank: int, world_size: int, work: str, full: dict) -> dict:
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    cfg = load_model_config(MODEL)
    batches = _batches(cfg.vocab_size)
    out: dict = {}
    for name, fields in LAYOUTS:
        parallel = ParallelConfig(**fields)
        groups = initialize_model_parallel(parallel, seed=3)
        try:
            grouped, sequential = _models(parallel)
            for chunks in (grouped, sequential):
                mcore_weights.load_full_state_dict(chunks, full)
            out[name] = {
                "entries": _entry_mismatches(_sharded_entries(grouped[0]), _sharded_entries(sequential[0])),
                "params": _expert_tensors(grouped),
                "padded": _forward_backward(grouped, batches["padded"], batches["weights"], cfg.vocab_size),
                "etp": (groups.etp_rank, groups.etp_size),
                "dispatcher": type(grouped[0].decoder.layers[0].mlp.token_dispatcher).__name__,
            }
        finally:
            destroy_model_parallel()
    fields = dict(expert_model_parallel_size=2)
    out["ep2_to_ep1"] = _checkpoint_swap(os.path.join(work, "ep2"), GROUPED, SEQUENTIAL, False, fields, {})
    return out


@pytest.fixture(scope="module")
def ep1(tmp_path_factory) -> dict:
    return run_distributed(_ep1_worker, 1, str(tmp_path_factory.mktemp("grouped_ep1")), timeout=400)[0]


@pytest.fixture(scope="module")
def ep2(ep1, tmp_path_factory) -> list[dict]:
    return run_distributed(_ep2_worker, 2, str(tmp_path_factory.mktemp("grouped_ep2")), ep1["full"], timeout=400)


def _assert_tensors(actual: dict, expected: dict, tol: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual.keys() ^ expected.keys())[:4]}"
    for name, (value, partition) in expected.items():
        assert actual[name][1] == partition, f"{what} {name}: partition {actual[name][1]} != {partition}"
        torch.testing.assert_close(actual[name][0], value, **tol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.megatron
@pytest.mark.dist
def test_grouped_builds_sequentials_weights_and_checkpoint_entries(ep1):
    assert ep1["kinds"] == ["GroupedExperts", "SequentialMLP"]
    grouped, sequential = ep1["init"]
    assert sum(".local_experts." in n for n in grouped) == 2 * 2 * 8  # 2 layers x 2 projections x 8 experts
    _assert_tensors(grouped, sequential, EXACT, "initial weights")
    assert ep1["entries"] == []  # keys, global shapes, offsets, replica ids, data
    # the weight sync's tensors: the same names, partitions and values (grouped lists a layer's
    # fc1 experts before its fc2 ones; the sync goes by name)
    grouped_shards, sequential_shards = (sorted(s, key=lambda shard: shard[0]) for s in ep1["shards"])
    assert [(n, p) for n, _, p in grouped_shards] == [(n, p) for n, _, p in sequential_shards]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(grouped_shards, sequential_shards, strict=True))


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_model_outputs_and_gradients_equal_sequential(ep1, kind):
    grouped, sequential = ep1[kind]
    torch.testing.assert_close(grouped["logits"], sequential["logits"], **EXACT)
    _assert_tensors(grouped["grads"], sequential["grads"], EXACT, f"{kind} gradient")


@pytest.mark.megatron
@pytest.mark.dist
def test_experts_module_equals_sequential_with_empty_experts(ep1):
    module = ep1["module"]
    seq = module["sequential"]
    for variant, tol in (("fallback", EXACT), ("grouped_mm", CLOSE)):
        res = module[variant]
        assert res["bias"] is None and seq["bias"] is None
        for key in ("out", "x", "probs"):
            torch.testing.assert_close(res[key], seq[key], **tol, msg=lambda m: f"{variant} {key}: {m}")
        for (fc, j), grad in module["sequential_grads"].items():
            torch.testing.assert_close(res["grads"][(fc, j)], grad, **tol, msg=lambda m: f"{variant} {fc}[{j}]: {m}")
            if TOKENS_PER_EXPERT[j] == 0:
                assert not res["grads"][(fc, j)].any()
    assert module["no_host_read"][0] == sum(TOKENS_PER_EXPERT)


@pytest.mark.megatron
@pytest.mark.dist
def test_grouped_moe_layer_reads_nothing_on_the_host_at_ep1(ep1):
    layer = ep1["layer"]
    assert (layer["layer"], layer["dispatcher"]) == ("GroupedMoELayer", "LocalTokenDispatcher")
    assert layer["grouped"] == "no host read"  # router, dispatch, grouped_mm experts, combine; and backward
    # the controls: Megatron's dispatcher and SequentialMLP read the counts; the recorder sees a mask
    assert "host read" in layer["sequential"] and layer["sequential"] != "no host read"
    assert layer["control"] == ["index by a mask"]


@pytest.mark.megatron
@pytest.mark.dist
def test_local_dispatch_equals_megatrons_allgather_dispatcher_at_ep1(ep1):
    allgather = ep1["allgather"]
    assert allgather["dispatchers"] == ["LocalTokenDispatcher", "MoEAllGatherTokenDispatcher"]
    grouped, sequential = allgather["padded"]
    torch.testing.assert_close(grouped["logits"], sequential["logits"], **EXACT)
    _assert_tensors(grouped["grads"], sequential["grads"], EXACT, "allgather gradient")
    torch.testing.assert_close(grouped["logits"], ep1["padded"][0]["logits"], **EXACT)  # alltoall's setting


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.layout
def test_three_rl_steps_grouped_equal_sequential(ep1):
    grouped, sequential = ep1["train"]
    for step, (a, b) in enumerate(zip(grouped["history"], sequential["history"], strict=True)):
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], **TOL, msg=lambda m: f"step {step}: {m}")
        assert a["lr"] == b["lr"] and a["metrics"].keys() == b["metrics"].keys()
        for key, value in b["metrics"].items():
            torch.testing.assert_close(a["metrics"][key], value, **TOL, msg=lambda m: f"step {step} {key}: {m}")
    assert "moe/aux_loss" in grouped["history"][0]["metrics"]
    _assert_same_params(grouped, sequential, "grouped vs sequential after 3 steps")
    moved = [
        n for n, (p, _) in grouped["params"].items() if ".local_experts." in n and not torch.equal(p, ep1["full"][n])
    ]
    assert moved  # the experts trained


def _assert_swap(result: dict, what: str) -> None:
    _assert_tensors(result["loaded"]["params"], result["saved"]["params"], EXACT, f"{what} loaded")
    _assert_tensors(result["loaded"]["anchor"], result["saved"]["anchor"], EXACT, f"{what} anchor loaded")
    assert result["loaded"]["steps"] == result["saved"]["steps"]
    # the optimizer state and the schedule came along: one more step lands where the saver's did
    assert result["stepped"]["params"].keys() == result["continued"]["params"].keys()
    _assert_step_after_load(result["stepped"], result["continued"], f"{what} stepped")
    assert result["stepped"]["lr"] == pytest.approx(result["continued"]["lr"], rel=1e-12)


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.layout
@pytest.mark.parametrize("direction", ["g2s", "s2g"], ids=["grouped_to_sequential", "sequential_to_grouped_distopt"])
def test_checkpoint_loads_across_implementations(ep1, direction):
    _assert_swap(ep1[direction], direction)


@pytest.mark.megatron
@pytest.mark.dist
def test_hf_conversion_round_trip_through_grouped_experts_is_bit_exact(ep1):
    hf = ep1["hf"]
    assert [tool["code"] for tool in hf["tools"]] == [0, 0], hf["tools"]
    assert hf["kind"] == "GroupedExperts"
    torch.testing.assert_close(hf["logits"], hf["hf_logits"], **TOL)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in hf["original"]
    assert hf["back"].keys() == hf["original"].keys()
    for name, tensor in hf["original"].items():
        assert hf["back"][name].dtype == tensor.dtype and torch.equal(hf["back"][name], tensor), name


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for name, _ in LAYOUTS])
def test_expert_parallel_layouts_equal_ep1(ep1, ep2, layout):
    from megatron_empg.mcore.weights import tp_slice

    reference, _ = ep1["padded"]
    seen = set()
    for rank, result in enumerate(r[layout] for r in ep2):
        assert result["entries"] == [], f"rank {rank}"
        assert result["dispatcher"] == "MoEAlltoAllTokenDispatcher"  # the expert grid spans 2 ranks
        etp_rank, etp = result["etp"]
        torch.testing.assert_close(result["padded"]["logits"], reference["logits"], **TOL)
        for name, (grad, partition) in result["padded"]["grads"].items():
            full, _ = reference["grads"][name]
            expert = ".local_experts." in name
            # both ranks route the same rows: an expert sees them twice; its weights are split over ETP
            expected = 2 * tp_slice(full, partition, etp_rank, etp) if expert else full
            # fp32 sums in another order (expert-TP's reduce-scatter): an error relative to the scale
            tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))
            torch.testing.assert_close(grad, expected, **tol, msg=lambda m: f"rank {rank} {name}: {m}")
            seen.add(name)
        for name, (value, partition) in result["params"].items():  # loaded by per-expert name (TP 1)
            full = ep1["full"][name]
            expected = tp_slice(full, partition, etp_rank, etp) if ".local_experts." in name else full
            torch.testing.assert_close(value, expected, **EXACT, msg=lambda m: f"rank {rank} {name}: {m}")
    assert seen == reference["grads"].keys()  # the ranks' experts, by global name, are all of them


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.layout
def test_grouped_ep2_checkpoint_loads_into_sequential_at_ep1(ep2):
    for rank, result in enumerate(r["ep2_to_ep1"] for r in ep2):
        saved = result["saved"]["params"]
        assert len([n for n in saved if ".local_experts." in n]) == 2 * 2 * 4  # this rank's 4 experts
        loaded = {n: result["loaded"]["params"][n] for n in saved}
        _assert_tensors(loaded, saved, EXACT, f"rank {rank} loaded")
        assert result["continued"]["params"].keys() == saved.keys()  # this rank's: the bound's names
        _assert_step_after_load(result["stepped"], result["continued"], f"rank {rank} stepped")
