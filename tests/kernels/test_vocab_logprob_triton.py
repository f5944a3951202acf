"""``kernels.vocab_logprob_triton`` (the fused k = 0 passes) against the chunked torch path.

Every check runs the same call twice, with ``EMPG_VOCAB_KERNEL=torch`` and ``=triton``, and compares
the two: ``_local_pass``'s packed statistics, ``vocab_parallel_logprobs`` values and gradients (in
place and not, through the log-probs, the entropy or both), ``rl_loss`` for every kind of term it
has, and the same at TP = 2 on gloo ranks. Without CUDA the kernels run under Triton's interpreter
on CPU tensors (``tests.kernels.interpreter``: imported with TRITON_INTERPRET=1, and an autouse
fixture sets it around each test; where triton was imported before without it, the tests skip). With CUDA they run
compiled, on the GPU, but for the TP = 2 test (CPU ranks on gloo: without CUDA only). Without a GPU,
one test also compiles the kernels for an H100 (``test_kernels_compile_for_sm90_with_vector_loads``),
which the interpreter does not.

Shapes: V_local = 37, 64, 100 with padding columns (garbage: NaN, +-inf, 1e4, which must not leak)
and one shard of padding only; one block per row (the default launch) and many blocks with a
partial last one (``BLOCK_BYTES`` = 64: 16 fp32 / 32 bf16 columns per iteration).

Tolerances, triton vs torch (both accumulate in fp32, in another order: online per block vs whole
chunk; exp of the same fp32 argument): fp32 values (lse ~ 10, log-probs, entropy) 5e-6 absolute +
1e-6 relative, a few fp32 ulps of the logsumexp; fp32 gradients the same; bf16 gradients one bf16
rounding (relative 2^-7) of fp32 values that agree to ~1e-6; the logits gathered at the ids are
copied, so equal exactly. ``rl_loss`` sums and metrics (up to ~5): 1e-5 relative + 5e-6 absolute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.kernels.interpreter import DEVICE, import_kernels, marks  # noqa: E402
from tests.kernels.interpreter import env as _env  # noqa: E402

triton, topk_triton, vocab_logprob_triton = import_kernels()
pytestmark = marks(triton, vocab_logprob_triton._local_stats_kernel)

from megatron_empg.core.microbatch import MicroBatch  # noqa: E402
from megatron_empg.kernels import KERNEL_ENV, vocab_logprob_kernels  # noqa: E402
from megatron_empg.parallel.rl_loss import rl_loss  # noqa: E402
from megatron_empg.parallel.vocab_parallel import (  # noqa: E402
    VocabShard,
    _local_pass,
    _owned_local_ids,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
)
from tests.dist import run_distributed  # noqa: E402

T, M = 9, 5  # tokens, ids per token (the last repeats the first; one id is never owned)
BF16_ULP = 2.0**-7
FP32_TOL = {"rtol": 1e-6, "atol": 5e-6}
TOL = {torch.float32: FP32_TOL, torch.bfloat16: {"rtol": BF16_ULP, "atol": 1e-5}}
LOSS_TOL = {"rtol": 1e-5, "atol": 5e-6}
# (V_local, n_valid, vocab_start): a shard in the middle of the vocabulary, the last shard with
# padding, a shard without padding, a shard of padding only.
SHARDS = [(37, 30, 40), (100, 97, 60), (64, 64, 0), (20, 0, 200)]
SHARD_IDS = [f"w{w}-valid{n}" for w, n, _ in SHARDS]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _mode(mode: str):
    return _env(KERNEL_ENV, mode)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if DEVICE == "cpu":  # the interpreter checks it at each launch
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["one-block", "many-blocks"])
def blocks(request, monkeypatch):
    if request.param == "many-blocks":
        _many_blocks(monkeypatch)


def _many_blocks(monkeypatch):
    """16 fp32 / 32 bf16 columns per program iteration: several blocks, the last one partial."""
    monkeypatch.setattr(vocab_logprob_triton, "BLOCK_BYTES", 64)


def _shard_logits(width: int, n_valid: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, width], rows 3 columns apart (a view, as of a wider buffer): 3 randn real columns (a
    few -inf among them), garbage in the padding."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(T, width + 3, generator=g)[:, 2 : 2 + width]
    if n_valid > 2:
        logits[::3, n_valid - 2] = float("-inf")  # a real column without mass
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e4])
    logits[:, n_valid:] = garbage[torch.randint(0, 4, (T, width - n_valid), generator=g)]
    return logits.to(dtype=dtype, device=DEVICE)


def _ids(n_valid: int, vocab_start: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[T, M] global ids: owned ones (none when n_valid = 0), one owned elsewhere, a repeat."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = vocab_start + torch.randint(0, max(n_valid - 2, 1), (T, M), generator=g)  # not the -inf column
    if n_valid == 0:
        ids = torch.randint(0, vocab_size, (T, M), generator=g)
    ids[:, 1] = (vocab_start + n_valid + 3) % vocab_size  # another rank's column
    ids[:, -1] = ids[:, 0]
    return ids.to(DEVICE)


def _vocab_size(n_valid: int, vocab_start: int) -> int:
    return vocab_start + n_valid if n_valid else vocab_start - 50  # n_valid = 0: the shard is past it


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.float(), expected.float(), **tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- dispatch


def test_dispatch_rule(monkeypatch):
    kernels = vocab_logprob_triton
    x = torch.zeros(4, 8, device=DEVICE)
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert vocab_logprob_kernels(x) is None
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert vocab_logprob_kernels(x) is (kernels if DEVICE == "cuda" else None)
    monkeypatch.delenv(KERNEL_ENV)
    assert vocab_logprob_kernels(x) is (kernels if DEVICE == "cuda" else None)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    assert vocab_logprob_kernels(x) is kernels
    assert vocab_logprob_kernels(x.bfloat16()) is kernels
    assert vocab_logprob_kernels(x.double()) is None  # fp64 (gradcheck): the torch path
    assert vocab_logprob_kernels(x.half()) is None
    assert vocab_logprob_kernels(torch.zeros(8, 4, device=DEVICE).t()) is None  # column stride 4
    monkeypatch.setenv(KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=f"^{KERNEL_ENV}='cuda' must be one of"):
        vocab_logprob_kernels(x)


def test_k0_passes_run_the_kernels(monkeypatch):
    """Forced triton: one forward and one backward launch per call, and one forward for
    ``vocab_parallel_token_stats`` at k = 0 (the anchor pass, and the old pass without a Top-k KL)."""
    calls = []
    for name in ("local_stats", "logsoftmax_backward"):
        fn = getattr(vocab_logprob_triton, name)
        counted = lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw)  # noqa: E731
        monkeypatch.setattr(vocab_logprob_triton, name, counted)
    logits = _shard_logits(37, 30, torch.float32, seed=0).clone().requires_grad_(True)
    ids = _ids(30, 0, 30, seed=0)
    with _mode("triton"):
        logprobs, entropy = vocab_parallel_logprobs(logits, ids, vocab_start=0, vocab_size=30, tp_group=None)
        (logprobs.sum() + entropy.sum()).backward()
        vocab_parallel_token_stats(logits.detach(), ids, 0, vocab_start=0, vocab_size=30, tp_group=None)
    assert calls == ["local_stats", "logsoftmax_backward", "local_stats"]


# ---------------------------------------------------------------- compiled for an H100, on any machine

_COMPILE_SM90 = textwrap.dedent(
    r"""
    import json, re
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megatron_empg.kernels import vocab_logprob_triton as K

    block, warps = K.launch_config(151936, torch.bfloat16)
    ints = {"logits_row_stride": "i64", "grad_row_stride": "i64", "width": "i32", "n_valid": "i32", "num_ids": "i32",
            "out_row_stride": "i32"}
    ptrs = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "cols_ptr": "*i64", "out_ptr": "*fp32"}
    out = {}
    for name, fn, flags in (("forward", K._local_stats_kernel, {"WITH_ENTROPY": True}),
                            ("backward", K._logsoftmax_backward_kernel, {"HAS_IDS_GRAD": True, "HAS_ENTROPY_GRAD": True}),
                            ("backward-entropy-only", K._logsoftmax_backward_kernel,
                             {"HAS_IDS_GRAD": False, "HAS_ENTROPY_GRAD": True})):
        consts = {**flags, "BLOCK": block, "BLOCK_M": 64}
        sig = {a: "constexpr" if a in consts else ints.get(a, ptrs.get(a, "*fp32")) for a in fn.arg_names}
        # what the launcher specializes at V_local = 151,936: pointers, strides and width divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if a.endswith("_ptr") or a in ("logits_row_stride", "grad_row_stride", "width")}
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        out[name] = len(re.findall(r"ld\.global[.\w]*\.v4\.b32", kernel.asm["ptx"]))
    print(json.dumps(out))
    """
)


def test_kernels_compile_for_sm90_with_vector_loads():
    """The interpreter runs Python; this compiles the default launch (bf16, 151,936 columns) to an H100
    cubin with triton's own ptxas, no GPU needed, and checks that the logits are read with 16 B loads."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    vector_loads = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(n >= 1 for n in vector_loads.values()), vector_loads


# ---------------------------------------------------------------- forward: packed statistics


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("width", "n_valid", "vocab_start"), SHARDS, ids=SHARD_IDS)
def test_local_pass_packed_statistics(blocks, width, n_valid, vocab_start, dtype, with_entropy):
    vocab_size = _vocab_size(n_valid, vocab_start)
    shard = VocabShard(vocab_start, vocab_size, None)
    logits = _shard_logits(width, n_valid, dtype, seed=width)
    local_ids, owned = _owned_local_ids(_ids(n_valid, vocab_start, vocab_size, seed=width), shard, n_valid)
    packed = {}
    for mode in ("torch", "triton"):
        with _mode(mode):
            packed[mode] = _local_pass(logits, local_ids, owned, shard, k=0, with_entropy=with_entropy, chunk_size=4)
    ours, expected = packed["triton"], packed["torch"]
    assert ours.shape == expected.shape == (T, (2 if with_entropy else 1) + M) and ours.dtype == torch.float32
    first = 2 if with_entropy else 1
    _close(ours[:, :first], expected[:, :first], FP32_TOL, "lse_local / mean logit")
    assert torch.equal(ours[:, first:], expected[:, first:]), "logits at the owned ids"
    assert bool(torch.isfinite(ours[:, 0]).all()) == (n_valid > 0)


# ---------------------------------------------------------------- backward: gradients


# (gradient through, in place): each once, in place and not for both outputs
GRAD_KINDS = [("both", True), ("both", False), ("logprobs-only", True), ("entropy-only", False), ("no-entropy", True)]
# (V_local, n_valid, vocab_start, many blocks)
GRAD_SHARDS = [(*SHARDS[0], False), (*SHARDS[1], True), (*SHARDS[2], True)]


def _logprobs_and_grad(logits, ids, kw, grad_kind, inplace, seed):
    g = torch.Generator().manual_seed(seed + 2)
    g_logprobs = torch.randn(T, M, generator=g).to(DEVICE)
    g_entropy = torch.randn(T, generator=g).to(DEVICE)
    leaf = logits.clone().requires_grad_(True)  # in place: the gradient overwrites this copy
    with_entropy = grad_kind != "no-entropy"
    logprobs, entropy = vocab_parallel_logprobs(
        leaf, ids, **kw, chunk_size=4, inplace_backward=inplace, with_entropy=with_entropy
    )
    outputs, upstream = {
        "both": ((logprobs, entropy), (g_logprobs, g_entropy)),
        "logprobs-only": ((logprobs,), (g_logprobs,)),
        "entropy-only": ((entropy,), (g_entropy,)),
        "no-entropy": ((logprobs,), (g_logprobs,)),
    }[grad_kind]
    (grad,) = torch.autograd.grad(outputs, leaf, upstream)
    aliases = grad.data_ptr() == leaf.data_ptr()
    return logprobs.detach(), None if entropy is None else entropy.detach(), grad, aliases


@pytest.mark.parametrize(
    ("grad_kind", "inplace"), GRAD_KINDS, ids=[f"{k}-{'in' if i else 'out-of'}-place" for k, i in GRAD_KINDS]
)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    ("width", "n_valid", "vocab_start", "many_blocks"),
    GRAD_SHARDS,
    ids=[f"{i}-{'many-blocks' if s[-1] else 'one-block'}" for i, s in zip(SHARD_IDS, GRAD_SHARDS)],
)
def test_logprobs_entropy_and_gradient(
    monkeypatch, width, n_valid, vocab_start, many_blocks, dtype, grad_kind, inplace
):
    if many_blocks:
        _many_blocks(monkeypatch)
    vocab_size = _vocab_size(n_valid, vocab_start)
    kw = dict(vocab_start=vocab_start, vocab_size=vocab_size, tp_group=None)
    logits = _shard_logits(width, n_valid, dtype, seed=width)
    ids = _ids(n_valid, vocab_start, vocab_size, seed=width)
    results = {}
    for mode in ("torch", "triton"):
        with _mode(mode):
            results[mode] = _logprobs_and_grad(logits, ids, kw, grad_kind, inplace, seed=width)
    (lp, ent, grad, aliases), (lp_ref, ent_ref, grad_ref, aliases_ref) = results["triton"], results["torch"]
    _close(lp, lp_ref, FP32_TOL, "logprobs")
    if grad_kind == "no-entropy":
        assert ent is None and ent_ref is None
    else:
        _close(ent, ent_ref, FP32_TOL, "entropy")
    assert grad.dtype == dtype and aliases == aliases_ref == inplace
    _close(grad, grad_ref, TOL[dtype], "gradient")
    assert torch.equal(grad[:, n_valid:], torch.zeros_like(grad[:, n_valid:])), "padding gradient"
    assert grad.abs().sum() > 0


# ---------------------------------------------------------------- rl_loss, every kind of term

B, S, V, K = 3, 4, 37, 4
WIDTH = 40  # TP = 1: V_pad = 40, three padded columns

RL_CASES = {
    "k1_entropy": dict(kl="k1", kl_coef=0.1, entropy_coef=0.01),
    "k2": dict(kl="k2", kl_coef=0.1),
    "k3_iw_seqmean": dict(
        kl="k3",
        kl_coef=0.1,
        kl_args={"importance_weight": True},
        agg_mode="seq-mean-token-mean",
    ),
    "topk_reverse_tail_iw": dict(
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
    ),
    "topk_forward_no_tail_entropy": dict(
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "forward", "tail": False},
        entropy_coef=0.02,
    ),
    "topk_forward_reference_tail": dict(
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "forward", "tail_grad": "reference"},
        log_entropy=False,
    ),
    "rpg_urkl": dict(kl="rpg_urkl", kl_coef=0.1, agg_mode="seq-mean-token-sum"),
    "grpo_corrected": dict(kl="grpo_corrected", kl_coef=0.2),
    "rpg_reinforce_clip": dict(
        policy_loss="rpg_reinforce_clip",
        policy_loss_args={"divergence": "ufkl", "beta": 0.1},
        log_entropy=False,
    ),
    "rpg_entropy": dict(policy_loss="rpg", policy_loss_args={"divergence": "rkl", "beta": 0.1}, entropy_coef=0.01),
}


def _rl_inputs(seed: int = 0) -> tuple[torch.Tensor, MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, S, WIDTH, generator=g)
    logits[..., V:] = 1e4  # padding: would dominate everything if not masked
    log_p = torch.log_softmax(logits[..., :V], -1)
    target = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[0, 0] = True
    anchor_log_p = torch.log_softmax(logits[..., :V] + 0.5 * torch.randn(B, S, V, generator=g), -1)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    topk_ids[0, :, 0] = target[0]  # some targets inside the index set
    batch = MicroBatch(
        input_ids=target,
        target_ids=target,
        loss_mask=mask,
        advantages=torch.randn(B, S, generator=g),
        old_logprobs=log_p.gather(-1, target[..., None])[..., 0] + 0.3 * torch.randn(B, S, generator=g),
        anchor_logprobs=anchor_log_p.gather(-1, target[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_anchor_logprobs=anchor_log_p.gather(-1, topk_ids),
    )
    return logits, batch


def _rl_loss_run(logits, batch, case, *, start, width, group, inplace):
    """rl_loss on the columns [start, start + width): (sum, metrics, gradient of the shard)."""
    leaf = logits[..., start : start + width].clone().requires_grad_(True)
    out = rl_loss(
        leaf,
        batch,
        vocab_start=start,
        vocab_size=V,
        tp_group=group,
        chunk_size=4,
        inplace_backward=inplace,
        **{"policy_loss": "ppo_clip", "agg_mode": "token-mean", **case},
    )
    (grad,) = torch.autograd.grad(out.loss.loss_sum, leaf)
    metrics = {name: m.loss_sum.detach() for name, m in out.metrics.items()}
    return out.loss.loss_sum.detach(), metrics, grad


def _compare_rl(ours, expected, what):
    (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = ours, expected
    _close(loss, loss_ref, LOSS_TOL, f"{what}: loss")
    assert metrics.keys() == metrics_ref.keys()
    for name in metrics_ref:
        _close(metrics[name], metrics_ref[name], LOSS_TOL, f"{what}: metric {name}")
    _close(grad, grad_ref, LOSS_TOL, f"{what}: gradient")
    assert grad_ref.abs().sum() > 0


@pytest.mark.parametrize("name", list(RL_CASES))
def test_rl_loss_triton_equals_torch(monkeypatch, name):
    """Many blocks; in place for every other case."""
    _many_blocks(monkeypatch)
    inplace = list(RL_CASES).index(name) % 2 == 0
    logits, batch = _rl_inputs()
    logits, batch = logits.to(DEVICE), batch.to(DEVICE)
    results = {}
    for mode in ("torch", "triton"):
        with _mode(mode):
            results[mode] = _rl_loss_run(
                logits, batch, RL_CASES[name], start=0, width=WIDTH, group=None, inplace=inplace
            )
    _compare_rl(results["triton"], results["torch"], name)


# ---------------------------------------------------------------- TP = 2 on gloo ranks (CPU)

TP_WIDTH = 19  # V = 37 pads to 38 at TP = 2: rank 1 has one padded column
TP_RL_CASES = ["k1_entropy", "topk_reverse_tail_iw", "rpg_entropy"]


def _tp2_worker(rank: int, world_size: int, logits, batch, ids, upstream) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"  # for the launches; this module was imported with it set
    group = dist.group.WORLD
    start = rank * TP_WIDTH
    shard = logits[:, start : start + TP_WIDTH]
    out = {}
    for mode in ("torch", "triton"):
        with _mode(mode):
            for dtype in (torch.float32, torch.bfloat16):
                for inplace in (False, True):
                    leaf = shard.to(dtype, copy=True).requires_grad_(True)
                    lp, ent = vocab_parallel_logprobs(
                        leaf,
                        ids,
                        vocab_start=start,
                        vocab_size=V,
                        tp_group=group,
                        chunk_size=4,
                        inplace_backward=inplace,
                    )
                    (grad,) = torch.autograd.grad((lp, ent), leaf, upstream)
                    out[mode, "logprobs", dtype, inplace] = (lp.detach(), ent.detach(), grad)
            full = logits.reshape(B, S, -1)
            for name in TP_RL_CASES:
                out[mode, "rl_loss", name] = _rl_loss_run(
                    full, batch, RL_CASES[name], start=start, width=TP_WIDTH, group=group, inplace=True
                )
    return out


@pytest.mark.dist
@pytest.mark.skipif(DEVICE == "cuda", reason="the ranks run the interpreter on CPU; here triton compiles for the GPU")
def test_tp2_gloo_triton_equals_torch():
    logits, batch = _rl_inputs(seed=1)
    logits = logits[..., : 2 * TP_WIDTH].reshape(B * S, -1).clone()
    logits[:, V:] = float("nan")  # the padded column
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B * S, M), generator=g)
    ids[:, -1] = ids[:, 0]
    upstream = (torch.randn(B * S, M, generator=g), torch.randn(B * S, generator=g))
    results = run_distributed(_tp2_worker, 2, logits, batch, ids, upstream, timeout=180)
    for rank, out in enumerate(results):
        for dtype in (torch.float32, torch.bfloat16):
            for inplace in (False, True):
                what = f"rank {rank} {dtype} inplace={inplace}"
                (lp, ent, grad), (lp_ref, ent_ref, grad_ref) = (
                    out[mode, "logprobs", dtype, inplace] for mode in ("triton", "torch")
                )
                _close(lp, lp_ref, FP32_TOL, f"{what}: logprobs")
                _close(ent, ent_ref, FP32_TOL, f"{what}: entropy")
                _close(grad, grad_ref, TOL[dtype], f"{what}: gradient")
        if rank == 1:
            assert torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1])), "padding gradient"
        for name in TP_RL_CASES:
            _compare_rl(out["triton", "rl_loss", name], out["torch", "rl_loss", name], f"rank {rank} {name}")
    # both ranks hold the same replicated values
    _close(
        results[0]["triton", "logprobs", torch.float32, False][0],
        results[1]["triton", "logprobs", torch.float32, False][0],
        FP32_TOL,
        "logprobs across ranks",
    )
