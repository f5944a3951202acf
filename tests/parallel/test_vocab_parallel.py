"""``parallel/vocab_parallel.py`` against the single-device ``core/`` references, on gloo ranks.

Each case holds full-vocab logits [T, V_pad]: the real vocabulary V in the first columns and
garbage in the padded columns V..V_pad (huge finite values, or +-inf and NaN), which every function
must ignore and give exactly zero gradient. The parent computes the oracles on the real columns:
``torch.log_softmax`` (values and the full [T, V] gradient), ``core.logprob`` (``gather_logprobs``,
``logsumexp_and_entropy``, ``topk_logprobs``) and ``core.topk_kl.topk_kl``. Each rank takes its
columns [tp_rank * V_local, (tp_rank + 1) * V_local) and checks its outputs and the gradient of
its shard against the matching columns of the oracle.

Layouts (V=37 pads to 38 at TP 2 and to 40 at TP 4; V=13 at TP 4 leaves ranks 2 and 3 with
padding only, as Megatron's padding to a multiple of 128 * TP does for tiny vocabularies):

    world 2:  TP=1 (one singleton group per rank, each with its own data), TP=2
    world 4:  TP=4, DP x TP = 2 x 2 (two TP groups built with new_group, different data per group)

times fp32 / bf16 logits, times "random" (continuous) / "ties" (logits on an integer grid: many
equal values, including across shards and at the top-k cut). Every case also has a loss_mask
that zeroes some tokens' upstream gradient.

Spawning costs several seconds per rank on 2 cores, so there is one spawn per world size (a
module-scoped fixture); each rank runs every case of its world and returns {check: failure}, and
the parametrized tests below look up their own check. Inside a rank every collective of a case
runs before any assertion, so a failing assertion on one rank cannot desynchronise the ranks.

Also here: a float64 gradcheck at TP=2 (ranks take turns, see ``_gradcheck_in_turns``), the
single-device path (tp_group=None) in this process, and, with no processes, a fake group that
counts collectives: one all-gather per forward call, none in backward, on the group passed in.

Tolerances (``_tolerances``): fp32 outputs to a few fp32 ulps of the logsumexp (5e-6 absolute;
the same fp32 arithmetic in another order). bf16 inputs: against the core reference run on the
same bf16 logits (upcast to fp32, which is what core does internally, so its values are the core
values bit for bit), 1e-5 on the fp32 outputs and one bf16 rounding on the (bf16) gradients; plus
a loose check against the fp32 reference on the unrounded logits, bounded by the rounding.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.logprob import gather_logprobs, logsumexp_and_entropy, topk_logprobs
from megatron_empg.core.topk_kl import topk_kl
from megatron_empg.parallel.vocab_parallel import (
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
    vocab_parallel_topk,
    vocab_parallel_topk_kl,
)
from tests.dist import run_distributed

T = 12  # tokens per case
M = 4  # ids per token for vocab_parallel_logprobs (the last repeats the first)
K_KL = 4  # index-set size for the Top-k KL
CHUNK = 5  # a chunk size that does not divide T
BF16_ULP = 2.0**-7  # relative spacing of bf16 numbers at most: one rounding step of a gradient


@dataclass(frozen=True)
class Layout:
    """``tp`` ranks per TP group, consecutive ranks; world_size // tp groups (DP replicas)."""

    name: str
    world_size: int
    tp: int
    vocab_size: int  # real V
    width: int  # V_local; V_pad = tp * width

    @property
    def groups(self) -> list[tuple[int, ...]]:
        return [tuple(range(s, s + self.tp)) for s in range(0, self.world_size, self.tp)]

    @property
    def padded(self) -> int:
        return self.tp * self.width

    def n_valid(self, tp_rank: int) -> int:
        """Real columns of this TP rank's shard."""
        return max(0, min(self.width, self.vocab_size - tp_rank * self.width))


LAYOUTS = [
    Layout("tp1-v37pad40", world_size=2, tp=1, vocab_size=37, width=40),
    Layout("tp2-v37pad38", world_size=2, tp=2, vocab_size=37, width=19),
    Layout("tp2-v40", world_size=2, tp=2, vocab_size=40, width=20),
    Layout("tp4-v37pad40", world_size=4, tp=4, vocab_size=37, width=10),
    Layout("tp4-v13pad40", world_size=4, tp=4, vocab_size=13, width=10),
    Layout("dp2xtp2-v37pad38", world_size=4, tp=2, vocab_size=37, width=19),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ("random", "ties")
CASE_IDS = [f"{lay.name}-{d}-{kind}" for lay in LAYOUTS for d in DTYPES for kind in KINDS]

# (direction, tail, tail_grad, with old_logprobs, iw_clip)
KL_VARIANTS = [
    (direction, tail, tail_grad, iw, clip)
    for direction in ("reverse", "forward")
    for tail, tail_grad, iw, clip in (
        (False, "unbiased", False, (None, None)),
        (True, "unbiased", False, (None, None)),
        (True, "reference", False, (None, None)),
        (True, "unbiased", True, (None, None)),
        (True, "reference", True, (0.8, 1.25)),
    )
]


@dataclass
class Case:
    name: str
    layout: Layout
    data: list[dict] = field(default_factory=list)  # one per TP group (DP replica)


# ---------------------------------------------------------------- oracles, in the parent


def _tolerances(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        # The same fp32 arithmetic in another order (per-rank logsumexp combined over ranks,
        # chunks). The logsumexp is ~10 here, where one fp32 ulp is ~1e-6, and log p = z - lse,
        # the entropy lse - E[z] and the gradient terms p (log p + H) inherit a few of those ulps
        # (up to 3.3e-6 observed).
        return {"values": {"rtol": 1e-6, "atol": 5e-6}, "grad": {"rtol": 1e-6, "atol": 5e-6}}
    # bf16 in, fp32 accumulators: the fp32 outputs agree to fp32 rounding as above; gradients
    # are bf16 (the logits' dtype), each rounded once from fp32 values that agree to ~1e-6, so
    # they may differ by one bf16 step.
    return {"values": {"rtol": 1e-6, "atol": 1e-5}, "grad": {"rtol": BF16_ULP, "atol": 1e-5}}


def _full_logits(layout: Layout, kind: str, g: torch.Generator) -> Tensor:
    """[T, V_pad] float32: real columns, then garbage in the padding."""
    v, pad = layout.vocab_size, layout.padded - layout.vocab_size
    if kind == "random":
        real = 3.0 * torch.randn(T, v, generator=g)
        garbage = 100.0 + 50.0 * torch.randn(T, pad, generator=g)  # would dominate softmax/top-k
    else:
        real = torch.round(1.5 * torch.randn(T, v, generator=g))  # integers in ~[-5, 5]: many ties
        choices = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e4])
        garbage = choices[torch.randint(0, 4, (T, pad), generator=g)]
    return torch.cat([real, garbage], dim=-1)


def _log_softmax_oracle(real32: Tensor, ids: Tensor, g_logprobs: Tensor, g_entropy: Tensor):
    """log_softmax on the whole real vocabulary: logprobs at ids, entropy, and their gradient."""
    leaf = real32.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(leaf, dim=-1)
    logprobs = log_p.gather(-1, ids)  # [T, M]
    entropy = -(log_p.exp() * log_p).sum(-1)  # [T]
    (grad,) = torch.autograd.grad((logprobs, entropy), leaf, (g_logprobs, g_entropy))
    return logprobs.detach(), entropy.detach(), grad


def _pad_columns(grad: Tensor, layout: Layout) -> Tensor:
    """[T, V] -> [T, V_pad] with zero gradient on the padded columns."""
    return torch.cat([grad, grad.new_zeros(grad.shape[0], layout.padded - layout.vocab_size)], dim=-1)


def _logprobs_data(layout, logits32, logits, mask, g) -> dict:
    v = layout.vocab_size
    real32 = logits[:, :v].float()  # exact upcast of the case's logits (bf16 or fp32)
    ids = torch.randint(0, v, (T, M), generator=g)
    ids[:, -1] = ids[:, 0]  # a repeated id: the backward must accumulate
    g_logprobs = torch.randn(T, M, generator=g)  # non-uniform upstream gradients on both outputs
    g_entropy = torch.randn(T, generator=g)
    masked = (torch.where(mask[:, None], g_logprobs, 0.0), torch.where(mask, g_entropy, 0.0))
    oracle_logprobs, oracle_entropy, oracle_grad = _log_softmax_oracle(real32, ids, *masked)
    # One output unused: its gradient is None in backward (set_materialize_grads(False)).
    *_, oracle_grad_logprobs_only = _log_softmax_oracle(real32, ids, masked[0], torch.zeros(T))
    *_, oracle_grad_entropy_only = _log_softmax_oracle(real32, ids, torch.zeros(T, M), masked[1])
    fp32_logprobs, fp32_entropy, _ = _log_softmax_oracle(logits32[:, :v], ids, *masked)
    # Loose bound for bf16 against the unrounded fp32 logits: log p_j = z_j - lse(z) moves by at
    # most 2 max|dz|, and H by about sum_j p_j |log p_j + H| max|dz| <= 2 H max|dz| <= 2 log(V) max|dz|.
    dz = (logits32[:, :v] - real32).abs().max().item()
    return {
        "ids": ids,
        "g_logprobs": g_logprobs,
        "g_entropy": g_entropy,
        "core_logprobs": gather_logprobs(logits[:, :v], ids).detach(),
        "core_entropy": logsumexp_and_entropy(logits[:, :v])[1],
        "oracle_logprobs": oracle_logprobs,
        "oracle_entropy": oracle_entropy,
        "oracle_lse": torch.logsumexp(real32, dim=-1),
        "oracle_grad": _pad_columns(oracle_grad, layout),
        "oracle_grad_logprobs_only": _pad_columns(oracle_grad_logprobs_only, layout),
        "oracle_grad_entropy_only": _pad_columns(oracle_grad_entropy_only, layout),
        "fp32_logprobs": fp32_logprobs,
        "fp32_entropy": fp32_entropy,
        "loose_atol": {"logprobs": 2.0 * dz * 1.01 + 1e-5, "entropy": 2.0 * math.log(v) * dz * 1.5 + 1e-5},
    }


def _topk_data(layout, logits) -> dict:
    v = layout.vocab_size
    real = logits[:, :v]
    entries = []
    for k in sorted({1, 5, min(layout.width + 3, v), v}):
        values, ids = topk_logprobs(real, k)
        top = torch.topk(real.float(), k, dim=-1)
        kth = top.values[:, -1:]
        no_boundary_tie = (real.float() == kth).sum(-1) == (top.values == kth).sum(-1)  # [T]
        entries.append({"k": k, "values": values, "ids": ids, "torch_ids": top.indices, "clean": no_boundary_tie})
    return {"topk": entries}


def _topk_kl_data(layout, logits, mask, g) -> dict:
    v = layout.vocab_size
    real32 = logits[:, :v].float()
    anchor_log_p = torch.log_softmax(real32 + 0.5 * torch.randn(T, v, generator=g), dim=-1)
    old_log_p = torch.log_softmax(real32 + 0.3 * torch.randn(T, v, generator=g), dim=-1)
    index_sets = {  # reverse: top-k of pi_old; forward: top-k of the anchor
        "reverse": topk_logprobs(old_log_p, K_KL)[1],
        "forward": topk_logprobs(anchor_log_p, K_KL)[1],
    }
    token_ids = torch.randint(0, v, (T,), generator=g)
    in_head_pick = torch.randint(0, K_KL, (T,), generator=g)
    use_head = torch.arange(T) % 2 == 0  # half the tokens inside the index set, half (mostly) outside
    w_values, w_logprobs = torch.randn(T, generator=g), torch.randn(T, generator=g)
    upstream = (torch.where(mask, w_values, 0.0), torch.where(mask, w_logprobs, 0.0))
    variants = []
    for direction, tail, tail_grad, iw, clip in KL_VARIANTS:
        index_set = index_sets[direction]
        tokens = torch.where(use_head, index_set.gather(-1, in_head_pick[:, None])[:, 0], token_ids)
        inputs = {
            "token_ids": tokens,
            "index_set": index_set,
            "head_anchor_logprobs": anchor_log_p.gather(-1, index_set),
            "anchor_logprobs": anchor_log_p.gather(-1, tokens[:, None])[:, 0],
        }
        options = {"direction": direction, "tail": tail, "tail_grad": tail_grad, "iw_clip": clip}
        options["old_logprobs"] = old_log_p.gather(-1, tokens[:, None])[:, 0] if iw else None
        leaf = real32.clone().requires_grad_(True)
        expected = topk_kl(leaf, **inputs, **options)
        expected_logprobs = gather_logprobs(leaf, tokens[:, None])[:, 0]
        (grad,) = torch.autograd.grad((expected.values, expected_logprobs), leaf, upstream)
        variants.append(
            {
                "name": f"{direction}-tail_{tail_grad if tail else 'off'}{'-iw' if iw else ''}",
                "inputs": inputs,
                "options": options,
                "values": expected.values.detach(),
                "head": expected.head.detach(),
                "tail": expected.tail.detach(),
                "logprobs": expected_logprobs.detach(),
                "grad": _pad_columns(grad, layout),
            }
        )
    return {"kl": variants, "kl_upstream": (w_values, w_logprobs)}


def _case_data(layout: Layout, dtype: torch.dtype, kind: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits32 = _full_logits(layout, kind, g)
    logits = logits32.to(dtype)
    mask = torch.rand(T, generator=g) < 0.7
    mask[0], mask[1] = True, False  # at least one token of each
    return {
        "logits": logits,
        "loss_mask": mask,
        "tol": _tolerances(dtype),
        "bf16": dtype == torch.bfloat16,
        **_logprobs_data(layout, logits32, logits, mask, g),
        **_topk_data(layout, logits),
        **_topk_kl_data(layout, logits, mask, g),
    }


def _case(case_id: str) -> Case:
    i = CASE_IDS.index(case_id)
    layout = LAYOUTS[i // (len(DTYPES) * len(KINDS))]
    _, dtype_name, kind = case_id.rsplit("-", 2)
    case = Case(case_id, layout)
    for replica in range(len(layout.groups)):  # different data per DP replica
        case.data.append(_case_data(layout, DTYPES[dtype_name], kind, seed=1000 * i + replica))
    return case


def _layout(case_id: str) -> Layout:
    return next(lay for lay in LAYOUTS if case_id.startswith(lay.name + "-"))


def _build_cases(world_size: int) -> list[Case]:
    return [_case(case_id) for case_id in CASE_IDS if _layout(case_id).world_size == world_size]


# ---------------------------------------------------------------- inside the ranks


def _close(actual: Tensor, expected: Tensor, what: str, tol: dict) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{what}: {m}")


def _assert_zero(t: Tensor, what: str) -> None:
    assert torch.equal(t, torch.zeros_like(t)), f"{what}: expected exact zeros, max |.| = {t.abs().max()}"


def _shard_kwargs(layout: Layout, group, tp_rank: int) -> dict:
    return {"vocab_start": tp_rank * layout.width, "vocab_size": layout.vocab_size, "tp_group": group}


def _columns(full: Tensor, layout: Layout, tp_rank: int) -> Tensor:
    return full[:, tp_rank * layout.width : (tp_rank + 1) * layout.width]


def _run_logprobs(d: dict, layout: Layout, group, tp_rank: int) -> dict:
    shard = _columns(d["logits"], layout, tp_rank)
    kw = _shard_kwargs(layout, group, tp_rank)
    mask = d["loss_mask"]
    masked = (torch.where(mask[:, None], d["g_logprobs"], 0.0), torch.where(mask, d["g_entropy"], 0.0))
    out = {}
    unmasked = (d["g_logprobs"], d["g_entropy"])
    for run, chunk, upstream in (("main", 1024, masked), ("unmasked", 1024, unmasked), ("chunked", CHUNK, masked)):
        leaf = shard.clone().requires_grad_(True)
        logprobs, entropy = vocab_parallel_logprobs(leaf, d["ids"], chunk_size=chunk, **kw)
        (grad,) = torch.autograd.grad((logprobs, entropy), leaf, upstream)
        out[run] = (logprobs.detach(), entropy.detach(), grad)
    leaf = shard.clone().requires_grad_(True)
    logprobs, no_entropy = vocab_parallel_logprobs(leaf, d["ids"], chunk_size=CHUNK, with_entropy=False, **kw)
    (grad,) = torch.autograd.grad(logprobs, leaf, masked[0])
    out["without_entropy"] = (logprobs.detach(), no_entropy, grad)
    leaf = shard.clone().requires_grad_(True)
    _, entropy = vocab_parallel_logprobs(leaf, d["ids"], chunk_size=CHUNK, **kw)
    (grad,) = torch.autograd.grad(entropy, leaf, masked[1])
    out["entropy_only"] = grad
    # inplace_backward on a non-leaf buffer, as Megatron's output layer produces.
    buffer = shard.clone().requires_grad_(True).clone()
    logprobs, entropy = vocab_parallel_logprobs(buffer, d["ids"], inplace_backward=True, **kw)
    (grad,) = torch.autograd.grad((logprobs, entropy), buffer, masked)
    out["inplace"] = (logprobs.detach(), entropy.detach(), grad, grad.data_ptr() == buffer.data_ptr())
    return out


def _check_logprobs(out: dict, d: dict, layout: Layout, tp_rank: int) -> None:
    tol, mask = d["tol"], d["loss_mask"]
    logprobs, entropy, grad = out["main"]
    assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == d["logits"].dtype
    _close(logprobs, d["core_logprobs"], "logprobs vs core.gather_logprobs", tol["values"])
    _close(logprobs, d["oracle_logprobs"], "logprobs vs log_softmax", tol["values"])
    _close(entropy, d["core_entropy"], "entropy vs core.logsumexp_and_entropy", tol["values"])
    _close(entropy, d["oracle_entropy"], "entropy vs log_softmax", tol["values"])
    expected_grad = _columns(d["oracle_grad"], layout, tp_rank)
    _close(grad, expected_grad, "shard grad vs log_softmax grad", tol["grad"])
    _assert_zero(grad[:, layout.n_valid(tp_rank) :], "grad of the padded columns")
    _assert_zero(grad[~mask], "grad of masked tokens")
    # The mask changes nothing else: unmasked tokens get bit-identical values and gradients.
    u_logprobs, u_entropy, u_grad = out["unmasked"]
    assert torch.equal(u_logprobs, logprobs) and torch.equal(u_entropy, entropy)
    assert torch.equal(u_grad[mask], grad[mask]), "the loss_mask changed unmasked tokens' gradients"
    c_logprobs, c_entropy, c_grad = out["chunked"]
    _close(c_logprobs, d["oracle_logprobs"], f"chunk_size={CHUNK} logprobs", tol["values"])
    _close(c_entropy, d["oracle_entropy"], f"chunk_size={CHUNK} entropy", tol["values"])
    _close(c_grad, expected_grad, f"chunk_size={CHUNK} grad", tol["grad"])
    w_logprobs, w_entropy, w_grad = out["without_entropy"]
    assert w_entropy is None
    _close(w_logprobs, d["oracle_logprobs"], "with_entropy=False logprobs", tol["values"])
    _close(w_grad, _columns(d["oracle_grad_logprobs_only"], layout, tp_rank), "with_entropy=False grad", tol["grad"])
    _close(
        out["entropy_only"], _columns(d["oracle_grad_entropy_only"], layout, tp_rank), "entropy-only grad", tol["grad"]
    )
    i_logprobs, i_entropy, i_grad, shares_storage = out["inplace"]
    assert shares_storage, "inplace_backward=True: the gradient is not written into the logits buffer"
    assert torch.equal(i_logprobs, logprobs) and torch.equal(i_entropy, entropy)
    assert torch.equal(i_grad, grad), "inplace_backward=True changed the gradient"
    if d["bf16"]:  # loose: against the fp32 reference on the logits before bf16 rounding
        loose = d["loose_atol"]
        _close(logprobs, d["fp32_logprobs"], "bf16 logprobs vs fp32", {"rtol": 0, "atol": loose["logprobs"]})
        _close(entropy, d["fp32_entropy"], "bf16 entropy vs fp32", {"rtol": 0, "atol": loose["entropy"]})


def _run_topk(d: dict, layout: Layout, group, tp_rank: int) -> list:
    shard = _columns(d["logits"], layout, tp_rank)
    kw = _shard_kwargs(layout, group, tp_rank)
    chunks = [CHUNK if i % 2 else 1024 for i in range(len(d["topk"]))]
    return [vocab_parallel_topk(shard, e["k"], chunk_size=c, **kw) for e, c in zip(d["topk"], chunks)]


def _check_topk(out: list, d: dict, layout: Layout, tp_rank: int) -> None:
    for (values, ids), e in zip(out, d["topk"], strict=True):
        k = e["k"]
        assert values.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
        assert torch.equal(ids, e["ids"]), f"k={k}: ids differ from core.topk_logprobs:\n{ids}\n{e['ids']}"
        _close(values, e["values"], f"k={k}: values vs core.topk_logprobs", d["tol"]["values"])
        clean = e["clean"]  # rows without ties at the k-th value: the same set as torch.topk
        actual_sets = ids[clean].sort(-1).values
        expected_sets = e["torch_ids"][clean].sort(-1).values
        assert torch.equal(actual_sets, expected_sets), f"k={k}: id sets differ from torch.topk"


def _run_topk_kl(d: dict, layout: Layout, group, tp_rank: int) -> list:
    shard = _columns(d["logits"], layout, tp_rank)
    kw = _shard_kwargs(layout, group, tp_rank)
    mask = d["loss_mask"]
    upstream = tuple(torch.where(mask, w, 0.0) for w in d["kl_upstream"])
    out = []
    for i, v in enumerate(d["kl"]):
        leaf = shard.clone().requires_grad_(True)
        kl, logprobs = vocab_parallel_topk_kl(
            leaf, **v["inputs"], **v["options"], chunk_size=CHUNK if i % 2 else 1024, **kw
        )
        (grad,) = torch.autograd.grad((kl.values, logprobs), leaf, upstream)
        out.append((kl.values.detach(), kl.head.detach(), kl.tail.detach(), logprobs.detach(), grad))
    return out


def _check_topk_kl(out: list, d: dict, layout: Layout, tp_rank: int) -> None:
    tol = d["tol"]
    for (values, head, tail, logprobs, grad), v in zip(out, d["kl"], strict=True):
        name = v["name"]
        _close(values, v["values"], f"{name}: values", tol["values"])
        _close(head, v["head"], f"{name}: head", tol["values"])
        _close(tail, v["tail"], f"{name}: tail", tol["values"])
        _close(logprobs, v["logprobs"], f"{name}: logprobs", tol["values"])
        _close(grad, _columns(v["grad"], layout, tp_rank), f"{name}: shard grad", tol["grad"])
        _assert_zero(grad[:, layout.n_valid(tp_rank) :], f"{name}: grad of the padded columns")
        _assert_zero(grad[~d["loss_mask"]], f"{name}: grad of masked tokens")


def _run_token_stats(d: dict, layout: Layout, group, tp_rank: int) -> list:
    shard = _columns(d["logits"], layout, tp_rank)
    kw = _shard_kwargs(layout, group, tp_rank)
    return [
        vocab_parallel_token_stats(shard, d["ids"], e["k"], chunk_size=CHUNK if i % 2 else 1024, **kw)
        for i, e in enumerate(d["topk"])
    ]


def _check_token_stats(out: list, d: dict, layout: Layout, tp_rank: int) -> None:
    tol = d["tol"]["values"]
    for stats, e in zip(out, d["topk"], strict=True):
        k = e["k"]
        _close(stats.logprobs, d["oracle_logprobs"], f"k={k}: logprobs vs log_softmax", tol)
        _close(stats.lse, d["oracle_lse"], f"k={k}: lse vs torch.logsumexp", tol)
        _close(stats.entropy, d["oracle_entropy"], f"k={k}: entropy vs log_softmax", tol)
        assert torch.equal(stats.topk_ids, e["ids"]), f"k={k}: top-k ids differ from core.topk_logprobs"
        _close(stats.topk_logprobs, e["values"], f"k={k}: top-k values vs core.topk_logprobs", tol)


CHECKS = {
    "logprobs": (_run_logprobs, _check_logprobs),
    "token_stats": (_run_token_stats, _check_token_stats),
    "topk": (_run_topk, _check_topk),
    "topk_kl": (_run_topk_kl, _check_topk_kl),
}


def _tp_groups(rank: int, layouts: list[Layout]) -> dict:
    """{rank tuple: group} for the groups holding ``rank``; every rank creates every group in order."""
    mine, created = {}, set()
    for layout in layouts:
        for ranks in layout.groups:
            if ranks not in created:
                created.add(ranks)
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[ranks] = group
    return mine


def _next_call(group, lead: bool, more: bool) -> bool:
    """One step of the leader's protocol: whether the leader calls the function once more."""
    flag = torch.tensor([1 if lead and more else 0])
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def _gradcheck_in_turns(rank: int, group, fn, shard: Tensor) -> None:
    """gradcheck of ``fn`` as a function of each rank's shard in turn, the other shards fixed.

    Forward does a collective, so every rank must call ``fn`` as often as the rank running
    gradcheck. Running gradcheck on all ranks at once would not do: they would perturb their own
    entry i at the same time, so the numerical Jacobian would be the sum over ranks of the partial
    derivatives. Instead the leader announces each call and the others call ``fn`` on their
    unperturbed shards, then the next rank leads.
    """
    for leader in range(dist.get_world_size(group)):
        if rank == leader:

            def announced(x):
                _next_call(group, lead=True, more=True)
                return fn(x)

            try:
                torch.autograd.gradcheck(announced, (shard,))
            finally:  # release the others even when gradcheck fails
                _next_call(group, lead=True, more=False)
        else:
            while _next_call(group, lead=False, more=False):
                fn(shard.detach())


def _gradcheck(rank: int, group, inputs: dict) -> None:
    """float64 gradcheck at TP=2 (V=9 padded to 10) of log-probs + entropy and the truncated Top-k KL."""
    width, vocab_size = inputs["width"], inputs["vocab_size"]
    shard = inputs["logits"][:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    kw = {"vocab_start": rank * width, "vocab_size": vocab_size, "tp_group": group, "chunk_size": 2}

    def logprobs_and_entropy(x):
        return vocab_parallel_logprobs(x, inputs["ids"], **kw)

    _gradcheck_in_turns(rank, group, logprobs_and_entropy, shard)
    for direction in ("reverse", "forward"):  # tail off: the tails hold stop-gradients by design

        def truncated_topk_kl(x, direction=direction):
            kl, logprobs = vocab_parallel_topk_kl(x, **inputs["kl"], direction=direction, tail=False, **kw)
            return kl.values, logprobs

        _gradcheck_in_turns(rank, group, truncated_topk_kl, shard)


def _run_cases(rank: int, world_size: int, cases: list[Case], gradcheck_inputs: dict | None) -> dict:
    """{"<case>/<check>": failure text} for every failing check of this rank (empty when all pass)."""
    groups = _tp_groups(rank, [case.layout for case in cases])
    failures = {}
    for case in cases:
        [(replica, ranks)] = [(i, r) for i, r in enumerate(case.layout.groups) if rank in r]
        tp_rank, d = ranks.index(rank), case.data[replica]
        for check_name, (run, check) in CHECKS.items():
            actual = run(d, case.layout, groups[ranks], tp_rank)  # every collective of the check
            try:
                check(actual, d, case.layout, tp_rank)
            except AssertionError:
                where = f"rank {rank} (tp_rank {tp_rank})"
                failures[f"{case.name}/{check_name}"] = f"{where}:\n{traceback.format_exc()}"
    if gradcheck_inputs is not None:  # last: a gradcheck failure leaves the ranks out of step
        _gradcheck(rank, groups[(0, 1)], gradcheck_inputs)
    return failures


# ---------------------------------------------------------------- tests


def _gradcheck_inputs() -> dict:
    g = torch.Generator().manual_seed(7)
    vocab_size, width, tokens = 9, 5, 3  # padded to 10 at TP 2
    logits = torch.randn(tokens, 2 * width, generator=g, dtype=torch.float64)
    index_set = torch.stack([torch.randperm(vocab_size, generator=g)[:3] for _ in range(tokens)])
    token_ids = torch.tensor([int(index_set[0, 1]), 8, 0])  # inside, then (likely) outside the set
    anchor = torch.log_softmax(torch.randn(tokens, vocab_size, generator=g, dtype=torch.float64), -1)
    kl = {
        "token_ids": token_ids,
        "index_set": index_set,
        "head_anchor_logprobs": anchor.gather(-1, index_set),
        "anchor_logprobs": anchor.gather(-1, token_ids[:, None])[:, 0],
    }
    ids = torch.randint(0, vocab_size, (tokens, 3), generator=g)
    return {"logits": logits, "ids": ids, "kl": kl, "width": width, "vocab_size": vocab_size}


@pytest.fixture(scope="module")
def rank_failures():
    """world_size -> {check: failure text}, merged over ranks; one spawn per world size, on demand."""
    cache: dict[int, dict | BaseException] = {}

    def get(world_size: int) -> dict:
        if world_size not in cache:
            gradcheck_inputs = _gradcheck_inputs() if world_size == 2 else None
            try:
                cases = _build_cases(world_size)
                per_rank = run_distributed(_run_cases, world_size, cases, gradcheck_inputs, timeout=240)
                cache[world_size] = {k: v for failures in per_rank for k, v in failures.items()}
            except BaseException as e:  # also pytest's Failed; report it for every test of this world
                cache[world_size] = e
        if isinstance(cache[world_size], BaseException):
            raise cache[world_size]
        return cache[world_size]

    return get


def _failures_of(rank_failures, case_id: str, check: str) -> list[str]:
    failures = rank_failures(_layout(case_id).world_size)
    return [text for name, text in failures.items() if name == f"{case_id}/{check}"]


@pytest.mark.dist
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_logprobs_and_entropy_match_log_softmax(rank_failures, case_id):
    failures = _failures_of(rank_failures, case_id, "logprobs")
    assert not failures, "\n".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_topk_matches_core_topk_logprobs(rank_failures, case_id):
    failures = _failures_of(rank_failures, case_id, "topk")
    assert not failures, "\n".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_token_stats_match_log_softmax_and_core_topk(rank_failures, case_id):
    failures = _failures_of(rank_failures, case_id, "token_stats")
    assert not failures, "\n".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_topk_kl_matches_core_topk_kl(rank_failures, case_id):
    failures = _failures_of(rank_failures, case_id, "topk_kl")
    assert not failures, "\n".join(failures)


@pytest.mark.dist
def test_gradcheck_float64_tp2(rank_failures):
    rank_failures(2)  # the world-2 spawn ends with the gradcheck; a failure there raises RankError


@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if c.endswith("-ties")])
def test_tie_cases_tie_at_the_topk_cut(case_id):
    """The "ties" data exercises the tie rule: in every replica some row ties across the k-th value."""
    for d in _case(case_id).data:
        assert any(not bool(e["clean"].all()) for e in d["topk"] if e["k"] < _layout(case_id).vocab_size)


@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if c.startswith("tp1-")])
def test_single_device_tp_group_none(case_id):
    """tp_group=None (a single device, no collective) passes the same checks, in this process."""
    case = _case(case_id)
    for check_name, (run, check) in CHECKS.items():
        d = case.data[0]
        check(run(d, case.layout, None, 0), d, case.layout, 0)


# ---------------------------------------------------------------- explicit group, collective count


OTHER_COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "get_rank",
)


class _FakeGroup:
    """Stands for a 2-rank TP group; a collective on any other group (or the default) fails."""


@pytest.fixture
def fake_collectives(monkeypatch):
    """torch.distributed with a fake group: all_gather records its calls and copies the local part."""
    fake_group, calls = _FakeGroup(), []

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        assert group is fake_group, f"all_gather on {group!r}, not the tp_group passed in"
        calls.append(tuple(tensor.shape))
        for part in tensor_list:
            part.copy_(tensor)

    def get_world_size(group=None):
        assert group is fake_group, f"get_world_size of {group!r}, not the tp_group passed in"
        return 2

    def forbidden(name):
        def collective(*args, **kwargs):
            raise AssertionError(f"unexpected torch.distributed.{name}")

        return collective

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", get_world_size)
    for name in OTHER_COLLECTIVES:
        monkeypatch.setattr(dist, name, forbidden(name))
    return fake_group, calls


def test_logprobs_one_all_gather_forward_none_backward_on_the_given_group(fake_collectives):
    group, calls = fake_collectives
    g = torch.Generator().manual_seed(0)
    for inplace in (False, True):
        logits = torch.randn(7, 6, generator=g).requires_grad_(True)  # [T, V_local], chunked below
        ids = torch.randint(0, 11, (7, 3), generator=g)
        logprobs, entropy = vocab_parallel_logprobs(
            logits, ids, vocab_start=6, vocab_size=11, tp_group=group, chunk_size=3, inplace_backward=inplace
        )
        assert calls == [(7, 2 + 3)], "one all-gather of [T, 2 + M] per forward call (module docstring)"
        (logprobs.sum() + entropy.sum()).backward()
        assert len(calls) == 1, "backward must not communicate"
        calls.clear()
    logprobs, _ = vocab_parallel_logprobs(
        logits.detach(), ids, vocab_start=6, vocab_size=11, tp_group=group, with_entropy=False
    )
    assert calls == [(7, 1 + 3)], "without the entropy: [T, 1 + M]"


def test_topk_and_topk_kl_one_all_gather_on_the_given_group(fake_collectives):
    group, calls = fake_collectives
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, generator=g).requires_grad_(True)
    kw = {"vocab_start": 0, "vocab_size": 12, "tp_group": group}
    vocab_parallel_topk(logits.detach(), 4, chunk_size=2, **kw)
    assert len(calls) == 1
    index_set = torch.randint(0, 12, (5, 3), generator=g)
    token_ids = torch.randint(0, 12, (5,), generator=g)
    anchor = (torch.full((5, 3), -2.0), torch.full((5,), -3.0))
    kl, logprobs = vocab_parallel_topk_kl(logits, token_ids, index_set, *anchor, direction="reverse", **kw)
    assert len(calls) == 2
    (kl.values.sum() + logprobs.sum()).backward()
    assert len(calls) == 2, "backward must not communicate"


def test_bad_ids_and_shapes_raise_naming_the_argument():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"ids must be in \[0, vocab_size=8\)"):
        vocab_parallel_logprobs(logits, torch.tensor([[1], [9], [0], [2]]), vocab_start=0, vocab_size=8, tp_group=None)
    with pytest.raises(ValueError, match="ids must be in"):
        vocab_parallel_logprobs(logits, torch.tensor([[1], [-1], [0], [2]]), vocab_start=0, vocab_size=8, tp_group=None)
    with pytest.raises(ValueError, match="token_ids"):
        vocab_parallel_topk_kl(
            logits,
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(4, 2, dtype=torch.int64),
            torch.zeros(4, 2),
            torch.zeros(4),
            vocab_start=0,
            vocab_size=8,
            tp_group=None,
            direction="reverse",
        )
