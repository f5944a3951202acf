"""A tiny Qwen2-like Megatron GPTModel gives the same logits, losses and gradients at TP=2, PP=2 and
TP=2 x PP=2 as at TP=1/PP=1.

The reference runs in its own 1-rank process at TP=1/PP=1 and returns its full weights, logits,
per-microbatch losses and full gradients. All parallel layouts then run in one 4-rank spawn, one
after another (the ranks not used by TP x PP are data-parallel replicas, with no gradient
reduction). Every rank loads its slice of the reference weights, runs forward and backward through
``get_forward_backward_func`` (two microbatches, cross-entropy on fixed labels via
``vocab_parallel_cross_entropy``) and returns its logits (gathered over TP) and the gradient of
every local parameter. The parent compares each gradient shard with the same slice of the TP=1
gradient, and checks that the layout's shards cover every parameter of the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.weights import global_name, layer_offset, load_full_state_dict, tp_partition, tp_slice
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.layout]

VOCAB, SEQ, MICRO_BATCH, NUM_MICROBATCHES, NUM_LAYERS = 128, 16, 2, 2, 4
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (TP, PP)
WORLD_SIZE = 4
# fp32; TP and PP change how reductions (matmul k-splits, all-reduce order) are grouped, so values
# agree to rounding only. Observed max |diff| is ~1e-7; 1e-5 leaves headroom without hiding bugs.
TOL = dict(rtol=1e-5, atol=1e-5)


def _setup(tp: int, pp: int) -> None:
    """Shims, model-parallel groups and the RNG tracker; the process group already exists."""
    cpu_shims.install_pre_import()
    import megatron.core  # noqa: F401  (after the pre-import shims)
    from megatron.core import parallel_state, tensor_parallel

    cpu_shims.install_post_import()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _build_model(tp: int, pp: int):
    """Qwen2-like: RMSNorm, SwiGLU, RoPE, GQA (4 heads, 2 KV groups), QKV bias, untied output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        add_qkv_bias=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        rotary_base=1_000_000,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _forward_step(data_iterator, model):
    from megatron.core import tensor_parallel

    batch = next(data_iterator)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked out
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    output = model(batch["tokens"], positions, mask)  # last stage: vocab-sharded logits [b, s, V/tp]

    def loss_func(logits):
        # gather first: vocab_parallel_cross_entropy overwrites its input logits in place
        full_logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach().clone())
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, batch["labels"])
        loss_sum, num_tokens = per_token.sum(), torch.tensor(per_token.numel(), dtype=torch.int)
        # clone: the schedule divides the returned loss in place by num_tokens and num_microbatches
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().clone(), "logits": full_logits}

    return output, loss_func


def _forward_backward(model, batches: list[dict]) -> tuple[list[dict], dict]:
    """One training forward/backward through Megatron's schedule; returns (per-microbatch, grads)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return outputs, grads


def _reference(rank: int, world_size: int, batches: list[dict]) -> dict:
    _setup(tp=1, pp=1)
    torch.manual_seed(0)
    model = _build_model(tp=1, pp=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms init to 1 and biases to 0; make them matter
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    state_dict = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    outputs, grads = _forward_backward(model, batches)
    return {"state_dict": state_dict, "outputs": outputs, "grads": grads}


def _run_layouts(rank: int, world_size: int, full_state_dict: dict, batches: list[dict]) -> dict:
    from megatron.core import parallel_state

    results = {}
    for tp, pp in LAYOUTS:
        _setup(tp, pp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        model = _build_model(tp, pp)
        offset = layer_offset(model)
        assert offset == pp_rank * NUM_LAYERS // pp
        load_full_state_dict([model], full_state_dict)
        outputs, grads = _forward_backward(model, batches)
        params = dict(model.named_parameters())
        results[tp, pp] = {
            "tp_rank": tp_rank,
            "pp_rank": pp_rank,
            "last_stage": parallel_state.is_pipeline_last_stage(),
            "outputs": outputs,
            "grads": {global_name(n, offset): (g, tp_partition(params[n])) for n, g in grads.items()},
        }
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
        }
        for _ in range(NUM_MICROBATCHES)
    ]


@pytest.fixture(scope="module")
def reference(batches) -> dict:
    return run_distributed(_reference, 1, batches, timeout=90)[0]


@pytest.fixture(scope="module")
def layouts(reference, batches) -> list[dict]:
    return run_distributed(_run_layouts, WORLD_SIZE, reference["state_dict"], batches, timeout=180)


def _layout_id(layout) -> str:
    return f"tp{layout[0]}_pp{layout[1]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_logits_and_losses_match_tp1(reference, layouts, layout):
    expected = reference["outputs"]
    last_stage_ranks = [r for r in layouts if r[layout]["last_stage"]]
    assert len(last_stage_ranks) == WORLD_SIZE // layout[1]
    for result in last_stage_ranks:
        actual = result[layout]["outputs"]
        assert len(actual) == len(expected) == NUM_MICROBATCHES
        for actual_mb, expected_mb in zip(actual, expected):
            assert actual_mb["logits"].shape == (MICRO_BATCH, SEQ, VOCAB)
            torch.testing.assert_close(actual_mb["logits"], expected_mb["logits"], **TOL)
            torch.testing.assert_close(actual_mb["loss_sum"], expected_mb["loss_sum"], **TOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_grads_match_tp1(reference, layouts, layout):
    tp_size = layout[0]
    expected_grads = reference["grads"]
    covered = set()
    for rank, result in enumerate(layouts):
        r = result[layout]
        for name, (actual, partition) in r["grads"].items():
            expected = tp_slice(expected_grads[name], partition, r["tp_rank"], tp_size)
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"rank {rank}, {name}: {m}")
            covered.add(name)
    assert covered == set(expected_grads)
