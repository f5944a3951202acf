#!/usr/bin/env python
"""CPU benchmark of the chunked / vocab-parallel Top-k KL against a naive full log-softmax pipeline.

    python benchmarks/topk_kl.py [--tokens 4096] [--vocab 151936] [--k 32] [--chunk-size N]
                                 [--repeats R] [--tp 1,2,4] [--out benchmarks/results/topk_kl_cpu.json]

Single process, forward + backward of one update-pass loss (mean of the per-token Top-k KL), bf16
logits, reverse direction (q = top-k of pi_old, tail sampling, importance weight on the tail):

  ours_vp_inplace   megatron_empg.parallel.vocab_parallel.vocab_parallel_topk_kl(tp_group=None,
                    inplace_backward=True): the gradient is written into the logits buffer
  ours_vp           the same with inplace_backward=False
  ours_core         megatron_empg.core.topk_kl.topk_kl (validate=True, the default: also scans the
                    logits for NaN/inf)
  ours_core_novalidate   the same with validate=False
  naive_emapg       ema-pg update pass in plain torch (docs/design/ema-pg.md 3.1 step 4 + section 3):
                    log_softmax(logits.float()) [T, V] with autograd, log pi(y) gathered from it,
                    logits gathered at q by advanced indexing, lse = z_y - log pi(y), head/tail math
  naive_logsoftmax  plain: log_softmax(logits.float()) [T, V], gather at the K+1 ids, same math
  exact_kl          megatron_empg.core.logprob.exact_kl on full policy and reference logits
                    (validate=False); inputs include the reference logits
  naive_emapg_with_ref   naive_emapg preceded, in the measured region, by the reference side of
                    ema-pg (no grad): log_softmax of the full bf16 reference logits, gathers at q and
                    y, lse trick; inputs include the reference logits
  ours_vp_inplace_with_anchor   ours_vp_inplace preceded by the anchor pass
                    vocab_parallel_logprobs(reference logits, K+1 ids) under no_grad

The trainer's path: what ``mcore.step`` runs for the ema-pg recipe (``TRAINER_RECIPE``: PPO clip,
reverse Top-k KL with the sampled tail and its importance weight, token-mean, the entropy logged),
with the loss bound by ``trainer.bind.build.bind_loss`` from the recipe's ``algorithm.loss``:

  ours_rl_loss      the update pass: ``_update_loss``'s call loss_fn(logits [1, T, V], MicroBatch,
                    vocab_start=0, tp_group=None) of ``parallel.rl_loss.rl_loss`` (log_entropy and
                    inplace_backward on, as the recipe), backward of ``loss.loss_sum``
  ours_rl_loss_noentropy   the same with log_entropy=False (what the entropy metric costs)
  old_pass          forward only: ``_stats_loss`` of the old pass, vocab_parallel_token_stats(ids =
                    the target, k = K, no entropy): log pi_old(y) and the top-k index set
  anchor_pass       forward only: ``_stats_loss`` of the anchor pass, vocab_parallel_token_stats(ids =
                    (y, top-k of pi_old), k = 0, no entropy): log pi_ref at the K+1 ids

``comparison.trainer_path`` gives, per token count (``--tokens`` and ``--trainer-tokens``), these
rows beside ours_vp_inplace (the bare function) and naive_emapg, and the ratios of the update pass
to the bare function (target: within 10% in time and memory) and to the naive pipeline.

Every (variant, tokens, chunk) measurement runs in a FRESH subprocess (see ``--help`` of the
method fields in the output JSON). Timings are wall-clock (perf_counter) per repeat after
``--warmup`` runs; memory is reported three ways:
  * peak_rss_extra: VmHWM (reset to the current RSS through /proc/self/clear_refs right after the
    inputs are created and touched) minus that RSS; falls back to ru_maxrss when the reset fails,
  * ru_maxrss_extra: getrusage(RUSAGE_SELF).ru_maxrss minus the RSS after the inputs,
  * tracked_peak: the peak of the running sum of the CPU allocations/frees that torch.profiler
    (profile_memory=True) records during one extra forward + backward (allocator-exact, no
    page-cache or glibc-arena effects).
The ratios ours/naive use tracked_peak as the primary memory number (RSS-based ratios are given
too). Nothing here asserts: the targets from the issue are recorded as booleans.

TP part (``--tp 2,4``): ranks spawned with torch.multiprocessing on gloo (127.0.0.1, free port);
torch.distributed collectives are wrapped inside the ranks to count the bytes every call sends,
for the update pass (vocab_parallel_topk_kl forward + backward = vocab_parallel_logprobs at K+1
ids), the anchor pass (vocab_parallel_logprobs, no grad), the old/anchor top-k pass
(vocab_parallel_topk) and, as the baseline, an actual full-vocab fp32 all-gather of the logits.
Results are also checked against the single-device functions on the gathered vocabulary.

GPU mode (``--device cuda``; default ``cpu``, whose behaviour and JSON are unchanged apart from
``params.device``): the same variants, each in a fresh subprocess, with the inputs generated on the
GPU. Times come from CUDA events around forward and backward (the stream drained before every
repeat, no host synchronization inside the timed region) after ``--warmup`` runs, median and min
over ``--repeats``; memory is the CUDA caching allocator's peak (``max_memory_allocated`` after
``reset_peak_memory_stats``, taken once the inputs exist) minus the bytes allocated at that point,
i.e. the peak extra memory above the inputs (``cuda_peak_extra_bytes``, the primary number of the
ratios there); an allocation failure (``torch.cuda.OutOfMemoryError``) is recorded as OOM and the
ours/naive comparison reruns at half the tokens as on CPU. No RLIMIT_AS, VmHWM or profiler there.
Achieved bandwidth = the bytes a variant must at least move over its median time, against the
device-to-device copy bandwidth measured in the same run (one large ``copy_``, bytes read +
written). The byte model: forward reads the bf16 logits [T, V] once, backward reads them once and
writes the gradient once (3 x T x V x 2 bytes; in place or not, the gradient is one [T, V] write;
the forward-only passes: one read), plus one read of the bf16 reference logits for the variants
that take them (their anchor/reference pass); the [T, k] / [T] side tensors are left out. The TP
part is skipped on CUDA (CPU/gloo only).
Default output there: benchmarks/results/topk_kl_gpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCHEMA = 1
MAIN_VARIANTS = (
    "ours_vp_inplace",
    "ours_rl_loss",
    "ours_rl_loss_noentropy",
    "old_pass",
    "anchor_pass",
    "ours_vp",
    "ours_core",
    "ours_core_novalidate",
    "naive_emapg",
    "naive_logsoftmax",
    "exact_kl",
    "naive_emapg_with_ref",
    "ours_vp_inplace_with_anchor",
)
VARIANT_DOC = {
    "ours_vp_inplace": "vocab_parallel_topk_kl(tp_group=None, inplace_backward=True); grad written into the logits buffer",
    "ours_vp": "vocab_parallel_topk_kl(tp_group=None, inplace_backward=False)",
    "ours_core": "core.topk_kl.topk_kl(validate=True, default): includes an isfinite scan of the [T, V] logits",
    "ours_core_novalidate": "core.topk_kl.topk_kl(validate=False)",
    "naive_emapg": "ema-pg update pass (docs/design/ema-pg.md 3.1 step 4 + section 3) in plain torch: "
    "log_softmax(logits.float()) [T,V] with autograd, log pi(y) gathered from it, logits[rows, q] "
    "(bf16 advanced indexing), lse = z_y - log pi(y), "
    "L1 + s * L2 with s = exp(clamp(sg(l - l_old), +-20)); reference side precomputed ([T,k] bf16 logits, lse, log pi_ref(y))",
    "naive_logsoftmax": "log_softmax(logits.float()) [T,V] with autograd, gather at the K+1 ids (q and y), same head/tail math",
    "exact_kl": "core.logprob.exact_kl(logits, ref_logits, direction='reverse', validate=False): full-vocab exact KL",
    "naive_emapg_with_ref": "naive_emapg plus, inside the measured forward, ema-pg's reference side from the full bf16 reference "
    "logits under no_grad (log_softmax(ref.float()), gather at q and y, lse trick)",
    "ours_vp_inplace_with_anchor": "ours_vp_inplace plus, inside the measured forward, the anchor pass "
    "vocab_parallel_logprobs(ref_logits, K+1 ids) under no_grad",
    "ours_rl_loss": "the trainer's update pass: parallel.rl_loss.rl_loss bound by trainer.bind.build.bind_loss from the "
    "ema-pg recipe's algorithm.loss (ppo_clip, reverse Top-k KL with tail and importance weight, token-mean, "
    "log_entropy and inplace_backward on) and called as mcore.step._update_loss does, on logits [1, T, V] and a "
    "MicroBatch (all tokens in the loss, random advantages); backward of loss.loss_sum",
    "ours_rl_loss_noentropy": "ours_rl_loss with log_entropy=False",
    "old_pass": "forward only, no grad: the recipe's old pass as mcore.step._stats_loss calls it, "
    "vocab_parallel_token_stats(logits, target ids [T, 1], k=K, with_entropy=False); loss = sum of its outputs",
    "anchor_pass": "forward only, no grad: the recipe's anchor pass as mcore.step._stats_loss calls it, "
    "vocab_parallel_token_stats(logits, [target, q] [T, K+1], k=0, with_entropy=False); loss = sum of its outputs",
}
NEEDS_REF_LOGITS = {"exact_kl", "naive_emapg_with_ref", "ours_vp_inplace_with_anchor"}
INPLACE = {"ours_vp_inplace", "ours_vp_inplace_with_anchor", "ours_rl_loss", "ours_rl_loss_noentropy"}
FORWARD_ONLY = {"old_pass", "anchor_pass"}
# The trainer's path: its update pass against the bare function (ours_vp_inplace) and the naive
# pipeline, and its two forward-only passes; measured together at every --trainer-tokens count.
TRAINER_RECIPE = "recipes/qwen2.5_3b_search_ema_pg.yaml"
TRAINER_GROUP = ("ours_vp_inplace", "ours_rl_loss", "ours_rl_loss_noentropy", "naive_emapg", "old_pass", "anchor_pass")
OURS = ("ours_vp_inplace", "ours_vp", "ours_core", "ours_core_novalidate")
NAIVE = ("naive_emapg", "naive_logsoftmax")
BENCHMARKED_SOURCES = (
    "megatron_empg/core/logprob.py",
    "megatron_empg/core/topk_kl.py",
    "megatron_empg/core/kl.py",
    "megatron_empg/core/checks.py",
    "megatron_empg/core/policy_loss.py",
    "megatron_empg/core/aggregation.py",
    "megatron_empg/parallel/vocab_parallel.py",
    "megatron_empg/parallel/rl_loss.py",
    TRAINER_RECIPE,
)
GPU_ONLY_ARGS = ("copy_gb",)  # left out of the CPU report's params (its JSON stays as it was)
CUDA_METHOD = {
    "process": "each (variant, tokens, chunk) in a fresh subprocess (python benchmarks/topk_kl.py --_child ...); "
    "inputs generated on the GPU (torch.Generator on cuda, chunks of 2048 rows), then gc + empty_cache, then the "
    "allocator baseline",
    "time": "CUDA events recorded before forward, between forward and backward (autograd.grad) and after backward; "
    "torch.cuda.synchronize() before each repeat (so each repeat starts on an idle stream and the event span is "
    "its wall time), none inside; elapsed times read after all repeats; median and min over --repeats after --warmup",
    "cuda_peak_extra_bytes": "torch.cuda.max_memory_allocated() after the repeats minus memory_allocated() after the "
    "inputs (reset_peak_memory_stats() at that point): the caching allocator's peak above the inputs over warmup + "
    "repeats (the gradient of the out-of-place variants included); the primary memory number of the ratios. "
    "cuda_peak_reserved_extra_bytes: the same for memory_reserved (segments the allocator holds)",
    "oom": "torch.cuda.OutOfMemoryError (or an allocation-failure message) is recorded as oom=true; the ours/naive "
    "comparison then reruns at half the tokens (down to --min-tokens)",
    "min_bytes_moved": "bytes a variant must at least move through device memory: forward reads the bf16 logits "
    "[T,V] once (T*V*2), backward reads them once and writes the [T,V] bf16 gradient once (2*T*V*2), in place or "
    "not; + one read of the bf16 reference logits (T*V*2) in the forward of exact_kl/*_with_ref/*_with_anchor; "
    "the [T,k]/[T] side tensors are not counted",
    "achieved_bandwidth_GBps": "min_bytes_moved / median time (total, forward, backward); fraction_of_copy_bandwidth "
    "divides it by device_copy_bandwidth.bandwidth_GBps",
    "device_copy_bandwidth": "one dst.copy_(src) of --copy-gb GiB of bf16 random data, 3 warm-ups, median of 20 "
    "CUDA-event timings, bytes read + bytes written; measured once per run in the info child",
}
MEM_SLACK = 1 << 30  # virtual-address slack on top of the memory budget of a child
OOM_MARKERS = ("not enough memory", "can't allocate memory", "cannot allocate memory", "out of memory", "MemoryError")


# --------------------------------------------------------------------------------------------
# small process / machine helpers (no torch)


def _proc_status(field: str) -> int | None:
    """A 'kB' field of /proc/self/status in bytes (None when unavailable)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s*kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _rss() -> int:
    value = _proc_status("VmRSS")
    if value is not None:
        return value
    import psutil

    return psutil.Process().memory_info().rss


def _reset_hwm() -> bool:
    """Reset VmHWM (and ru_maxrss) to the current RSS; False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
            cpu_model = m.group(1).strip() if m else None
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemTotal:\s+(\d+)\s*kB", f.read(), re.M)
            mem_total = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count_logical": os.cpu_count(),
        "cpu_affinity": usable,
        "ram_total_bytes": mem_total,
        "ram_available_bytes_at_start": _mem_available(),
        "loadavg_at_start": _loadavg(),
    }


def git_info() -> dict:
    dirty = _git("status", "--porcelain", "--", *BENCHMARKED_SOURCES)
    hashes = {}
    for rel in BENCHMARKED_SOURCES:
        try:
            hashes[rel] = hashlib.sha256((REPO / rel).read_bytes()).hexdigest()[:16]
        except OSError:
            hashes[rel] = None
    return {
        "commit": _git("rev-parse", "HEAD"),
        "benchmarked_sources_dirty": None if dirty is None else [line for line in dirty.splitlines() if line],
        "benchmarked_sources_sha256_16": hashes,
    }


# --------------------------------------------------------------------------------------------
# child: one (variant, tokens, chunk) measurement in a fresh process


def _make_inputs(spec: dict) -> dict:
    """Synthetic bf16 logits and the small tensors of the earlier passes, generated chunk-wise so
    that no [T, V] float32 transient raises the process's memory before the measurement."""
    import torch

    T, V, K = spec["tokens"], spec["vocab"], spec["k"]
    # spec["device"] is only set in GPU mode: on CPU the calls below draw exactly what they always did
    dev = torch.device(spec.get("device", "cpu"))
    gen = torch.Generator(device=dev).manual_seed(spec["seed"])
    rows = 256 if dev.type == "cpu" else 2048
    logits = torch.empty(T, V, dtype=torch.bfloat16, device=dev)
    need_ref = spec["variant"] in NEEDS_REF_LOGITS
    ref_logits = torch.empty(T, V, dtype=torch.bfloat16, device=dev) if need_ref else None
    q = torch.empty(T, K, dtype=torch.int64, device=dev)
    lse = torch.empty(T, device=dev)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        z = torch.randn(e - s, V, generator=gen, device=dev).mul_(spec["logit_scale"])
        logits[s:e] = z
        zb = logits[s:e].float()
        q[s:e] = torch.topk(zb, K, dim=-1).indices  # top-k of "pi_old" (= the policy here)
        lse[s:e] = torch.logsumexp(zb, -1)
        if need_ref:  # reference = policy + noise
            ref_logits[s:e] = z.add_(torch.randn(e - s, V, generator=gen, device=dev), alpha=spec["ref_noise"])
        del z, zb
    # sampled tokens: half from the index set (in_head), half uniform over the vocabulary
    pick = torch.randint(0, K, (T,), generator=gen, device=dev)
    token = torch.where(
        torch.rand(T, generator=gen, device=dev) < 0.5,
        q.gather(-1, pick[:, None]).squeeze(-1),
        torch.randint(0, V, (T,), generator=gen, device=dev),
    )
    ar = torch.arange(T, device=dev)
    logp_tok = logits[ar, token].float() - lse
    inputs = {"logits": logits, "token": token, "q": q, "ar": ar}
    inputs["old_logprobs"] = logp_tok + 0.05 * torch.randn(T, generator=gen, device=dev)
    if need_ref:
        inputs["ref_logits"] = ref_logits
    else:  # the reference side of an earlier pass: [T, K] bf16 logits, lse, log pi_ref(y)
        noise_k = torch.randn(T, K, generator=gen, device=dev)
        ref_logits_k = (logits.gather(-1, q).float() + spec["ref_noise"] * noise_k).bfloat16()
        ref_lse = lse + 0.05 * torch.randn(T, generator=gen, device=dev)
        ref_log_prob = logp_tok + spec["ref_noise"] * torch.randn(T, generator=gen, device=dev)
        inputs.update(
            ref_logits_k=ref_logits_k,
            ref_lse=ref_lse,
            ref_log_prob=ref_log_prob,
            head_anchor_logprobs=ref_logits_k.float() - ref_lse[:, None],
            anchor_logprobs=ref_log_prob,
        )
    if spec["variant"] in INPLACE:
        inputs["pristine"] = logits.clone()  # restores the logits between repeats (outside timing)
    inputs["logits"].requires_grad_(True)
    return inputs


def _kl_from_logprobs_plain(a, b, log_prob, ref_log_prob, old_log_prob, not_in):
    """ema-pg compute_memory_efficient_kl (full_reverse, tail sampling) + use_kl_iw, plain torch."""
    import torch

    L1 = (a.exp() * (a - b)).sum(-1)
    L2 = not_in * torch.exp(log_prob - log_prob.detach()) * (log_prob - ref_log_prob).detach()
    s = torch.exp(torch.clamp((log_prob - old_log_prob).detach(), -20, 20))
    return L1 + s * L2


def _naive_emapg_loss(logits, token, q, ar, ref_logits_k, ref_lse, ref_log_prob, old_log_prob):
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V] fp32 with autograd (logprobs_from_logits)
    log_prob = logp.gather(-1, token[:, None]).squeeze(-1)  # l = log pi_theta(y)
    del logp
    actor_logits_k = logits[ar[:, None], q]  # [T, k] bf16, advanced indexing as in dp_actor
    actor_lse = logits[ar, token] - log_prob  # the "cheap" lse: z_y - log pi(y), fp32
    a = actor_logits_k - actor_lse[:, None]
    b = ref_logits_k - ref_lse[:, None]
    not_in = ~(q == token[:, None]).any(-1)
    return _kl_from_logprobs_plain(a, b, log_prob, ref_log_prob, old_log_prob, not_in).mean()


def _build_forward(spec: dict, inp: dict):
    """A closure computing the scalar loss of the variant (forward only)."""
    import torch

    from megatron_empg.core.logprob import exact_kl
    from megatron_empg.core.topk_kl import topk_kl
    from megatron_empg.parallel.vocab_parallel import (
        vocab_parallel_logprobs,
        vocab_parallel_token_stats,
        vocab_parallel_topk_kl,
    )

    variant, V, K = spec["variant"], spec["vocab"], spec["k"]
    chunk = spec["chunk_size"]
    tail_grad = spec["tail_grad"]
    logits, token, q, ar, old = inp["logits"], inp["token"], inp["q"], inp["ar"], inp["old_logprobs"]

    def ours_vp(head_anchor, anchor, inplace):
        kl, _ = vocab_parallel_topk_kl(
            logits,
            token,
            q,
            head_anchor,
            anchor,
            vocab_start=0,
            vocab_size=V,
            tp_group=None,
            direction="reverse",
            tail_grad=tail_grad,
            old_logprobs=old,
            chunk_size=chunk,
            inplace_backward=inplace,
        )
        return kl.values.mean()

    def ours_core(validate):
        kl = topk_kl(
            logits,
            token,
            q,
            inp["head_anchor_logprobs"],
            inp["anchor_logprobs"],
            direction="reverse",
            tail_grad=tail_grad,
            old_logprobs=old,
            chunk_size=chunk,
            validate=validate,
        )
        return kl.values.mean()

    if variant in ("ours_vp_inplace", "ours_vp"):
        return lambda: ours_vp(inp["head_anchor_logprobs"], inp["anchor_logprobs"], variant == "ours_vp_inplace")
    if variant in ("ours_core", "ours_core_novalidate"):
        return lambda: ours_core(variant == "ours_core")
    if variant == "naive_emapg":
        return lambda: _naive_emapg_loss(
            logits, token, q, ar, inp["ref_logits_k"], inp["ref_lse"], inp["ref_log_prob"], old
        )
    if variant == "naive_logsoftmax":

        def f():
            logp = torch.log_softmax(logits.float(), dim=-1)
            g = logp.gather(-1, torch.cat([q, token[:, None]], -1))  # [T, K+1]
            del logp
            not_in = ~(q == token[:, None]).any(-1)
            return _kl_from_logprobs_plain(
                g[:, :K], inp["head_anchor_logprobs"], g[:, K], inp["anchor_logprobs"], old, not_in
            ).mean()

        return f
    if variant == "exact_kl":
        return lambda: exact_kl(logits, inp["ref_logits"], direction="reverse", validate=False).mean()
    if variant == "naive_emapg_with_ref":
        ref = inp["ref_logits"]

        def f():
            with torch.no_grad():  # ema-pg compute_ref_log_prob_at_indices
                ref_logp = torch.log_softmax(ref.float(), dim=-1)
                ref_log_prob = ref_logp.gather(-1, token[:, None]).squeeze(-1)
                del ref_logp
                ref_logits_k = ref[ar[:, None], q]
                ref_lse = ref[ar, token] - ref_log_prob
            return _naive_emapg_loss(logits, token, q, ar, ref_logits_k, ref_lse, ref_log_prob, old)

        return f
    if variant == "ours_vp_inplace_with_anchor":
        ref = inp["ref_logits"]
        ids = torch.cat([q, token[:, None]], -1)

        def f():
            with torch.no_grad():
                lp, _ = vocab_parallel_logprobs(ref, ids, vocab_start=0, vocab_size=V, tp_group=None, chunk_size=chunk)
            return ours_vp(lp[:, :K], lp[:, K], True)

        return f
    if variant in ("ours_rl_loss", "ours_rl_loss_noentropy"):
        return _trainer_update_pass(spec, inp)
    if variant in FORWARD_ONLY:
        # mcore.step._stats_loss: the target first, then the extra ids (the anchor pass: q)
        ids = token[:, None] if variant == "old_pass" else torch.cat([token[:, None], q], -1)
        k = K if variant == "old_pass" else 0

        def f():
            with torch.no_grad():
                stats = vocab_parallel_token_stats(
                    logits.detach(),
                    ids,
                    k,
                    vocab_start=0,
                    vocab_size=V,
                    tp_group=None,
                    with_entropy=False,
                    chunk_size=chunk,
                )
            return stats.logprobs.sum() + stats.topk_logprobs.sum()

        return f
    raise ValueError(f"unknown variant {variant!r}")


def _trainer_update_pass(spec: dict, inp: dict):
    """The loss of ``mcore.step._update_loss`` with the recipe's ``algorithm.loss`` (``TRAINER_RECIPE``)
    bound by ``trainer.bind.build.bind_loss``, on the logits as one packed row [1, T, V]; a closure
    returning ``loss.loss_sum`` (the gradient's root). The chunk is the benchmark's; ``tp_group``
    None is a TP group of one (the same arithmetic, no collective)."""
    import torch

    from megatron_empg.config import LossConfig, load_config, read_yaml
    from megatron_empg.core.microbatch import MicroBatch
    from megatron_empg.trainer.bind.build import bind_loss

    T, V, K = spec["tokens"], spec["vocab"], spec["k"]
    section = read_yaml(REPO / TRAINER_RECIPE)["algorithm"]["loss"]
    section = {**section, "chunk_size": spec["chunk_size"], "log_entropy": spec["variant"] == "ours_rl_loss"}
    loss_fn, _ = bind_loss(load_config(LossConfig, section), vocab_size=V, topk=K)
    logits, token = inp["logits"], inp["token"]
    gen = torch.Generator(device=token.device).manual_seed(spec["seed"] + 1)
    batch = MicroBatch(
        input_ids=token[None],
        target_ids=token[None],
        loss_mask=torch.ones(1, T, dtype=torch.bool, device=token.device),
        advantages=torch.randn(1, T, generator=gen, device=token.device),
        old_logprobs=inp["old_logprobs"][None],
        anchor_logprobs=inp["anchor_logprobs"][None],
        topk_ids=inp["q"][None],
        topk_anchor_logprobs=inp["head_anchor_logprobs"][None],
    )
    return lambda: loss_fn(logits.view(1, T, V), batch, vocab_start=0, tp_group=None).loss.loss_sum


def _chunked_sq_norm(t) -> float:
    total = 0.0
    for s in range(0, t.shape[0], 256):
        total += float(t[s : s + 256].float().pow(2).sum())
    return math.sqrt(total)


def _tracked_run(step, restore) -> dict:
    """One forward + backward under torch.profiler(profile_memory=True): allocator-exact peak and
    the top ops by self CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    restore()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(keep=False)
    events = prof.profiler.kineto_results.events()
    mem = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    cur = peak = 0
    for _, nbytes in mem:
        cur += nbytes
        peak = max(peak, cur)
    ops = []
    for avg in sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]:
        ops.append({"op": avg.key, "calls": avg.count, "self_cpu_s": round(avg.self_cpu_time_total / 1e6, 4)})
    return {"tracked_peak_bytes": peak, "tracked_end_bytes": cur, "tracked_events": len(mem), "top_ops_self_cpu": ops}


def _set_mem_limit(budget: int | None) -> int | None:
    """RLIMIT_AS = current virtual size + budget: an allocation beyond raises inside torch instead
    of waking the OOM killer on a shared machine."""
    if budget is None:
        return None
    vm = _proc_status("VmSize")
    if vm is None:
        return None
    limit = vm + budget
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):
        return None
    return limit


def child_bench(spec: dict) -> dict:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    out = {
        "variant": spec["variant"],
        "tokens": spec["tokens"],
        "chunk_size": spec["chunk_size"],
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": _loadavg(),
    }
    t0 = time.perf_counter()
    inp = _make_inputs(spec)
    out["setup_s"] = round(time.perf_counter() - t0, 3)
    out["input_bytes"] = sum(t.numel() * t.element_size() for t in inp.values() if isinstance(t, torch.Tensor))
    forward = _build_forward(spec, inp)
    logits = inp["logits"]
    inplace = spec["variant"] in INPLACE
    forward_only = spec["variant"] in FORWARD_ONLY

    def restore():
        if inplace:
            with torch.no_grad():
                logits.copy_(inp["pristine"])

    state = {}

    def step(keep: bool):
        ta = time.perf_counter()
        loss = forward()
        tb = time.perf_counter()
        grad = None if forward_only else torch.autograd.grad(loss, logits)[0]
        tc = time.perf_counter()
        if keep:
            state["loss"], state["grad"] = float(loss), grad
        return tb - ta, tc - tb

    gc.collect()
    out["rss_after_inputs_bytes"] = rss0 = _rss()
    out["mem_available_bytes"] = _mem_available()
    budget = spec.get("mem_budget")
    if budget is None and out["mem_available_bytes"] is not None:
        budget = max(out["mem_available_bytes"] - (1 << 30), 1 << 30)
    # + slack: RLIMIT_AS counts virtual reservations (malloc arenas, thread stacks, profiler buffers)
    out["rlimit_as_bytes"] = _set_mem_limit(None if budget is None else budget + MEM_SLACK)
    out["hwm_reset"] = _reset_hwm()
    fwd, bwd = [], []
    try:
        for i in range(spec["warmup"] + spec["repeats"]):
            restore()
            last = i == spec["warmup"] + spec["repeats"] - 1
            f, b = step(keep=last)
            if i >= spec["warmup"]:
                fwd.append(f)
                bwd.append(b)
        hwm = _proc_status("VmHWM") if out["hwm_reset"] else None
        maxrss = _ru_maxrss()
        out["peak_rss_extra_bytes"] = (hwm if hwm is not None else maxrss) - rss0
        out["peak_rss_method"] = "VmHWM after clear_refs reset" if hwm is not None else "ru_maxrss"
        out["ru_maxrss_extra_bytes"] = maxrss - rss0
        grad = state.pop("grad")
        if grad is not None:
            out["grad_aliases_logits"] = grad.data_ptr() == logits.data_ptr()
            out["grad_dtype"] = str(grad.dtype)
            out["grad_norm"] = _chunked_sq_norm(grad)
        out["loss"] = state["loss"]
        del grad
        gc.collect()
        if spec["tracked"]:
            out.update(_tracked_run(step, restore))
        out["ok"] = True
    except (RuntimeError, MemoryError) as err:
        msg = f"{type(err).__name__}: {err}"
        out["ok"] = False
        out["oom"] = any(m.lower() in msg.lower() for m in OOM_MARKERS)
        out["error"] = msg[:500]
    out["time_fwd_s"] = [round(x, 4) for x in fwd]
    out["time_bwd_s"] = [round(x, 4) for x in bwd]
    tot = sorted(f + b for f, b in zip(fwd, bwd))
    if tot:
        out["time_total_s"] = {
            "median": round(
                tot[len(tot) // 2] if len(tot) % 2 else (tot[len(tot) // 2 - 1] + tot[len(tot) // 2]) / 2, 4
            ),
            "min": round(tot[0], 4),
            "all": [round(x, 4) for x in (f + b for f, b in zip(fwd, bwd))],
        }
    out["loadavg_after"] = _loadavg()
    return out


# --------------------------------------------------------------------------------------------
# child: the same measurement on a CUDA device (events, allocator stats)


def min_bytes_moved(variant: str, tokens: int, vocab: int) -> dict:
    """The byte model of the GPU mode (module docstring): bf16 logits read once in forward, read once
    and the gradient written once in backward (the forward-only passes: one read); + one read of the
    reference logits where they are an input. The [T, k] / [T] side tensors are not counted."""
    tv2 = tokens * vocab * 2
    if variant in FORWARD_ONLY:
        return {"forward": tv2, "backward": 0, "total": tv2}
    ref = tv2 if variant in NEEDS_REF_LOGITS else 0
    return {"forward": tv2 + ref, "backward": 2 * tv2, "total": 3 * tv2 + ref}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def child_bench_cuda(spec: dict) -> dict:
    import torch

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    out = {
        "variant": spec["variant"],
        "tokens": spec["tokens"],
        "chunk_size": spec["chunk_size"],
        "device": torch.cuda.get_device_name(dev),
    }
    fwd_ms: list[float] = []
    bwd_ms: list[float] = []
    try:
        t0 = time.perf_counter()
        inp = _make_inputs(dict(spec, device="cuda"))
        torch.cuda.synchronize()
        out["setup_s"] = round(time.perf_counter() - t0, 3)
        out["input_bytes"] = sum(t.numel() * t.element_size() for t in inp.values() if isinstance(t, torch.Tensor))
        forward = _build_forward(spec, inp)
        logits = inp["logits"]
        inplace = spec["variant"] in INPLACE
        forward_only = spec["variant"] in FORWARD_ONLY
        state: dict = {}

        def restore():
            if inplace:
                with torch.no_grad():
                    logits.copy_(inp["pristine"])

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["cuda_allocated_after_inputs_bytes"] = base = torch.cuda.memory_allocated(dev)
        out["cuda_reserved_after_inputs_bytes"] = base_reserved = torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        n = spec["warmup"] + spec["repeats"]
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
        for i in range(n):
            restore()  # outside the timed region
            torch.cuda.synchronize()  # every repeat starts on an idle stream
            e0, e1, e2 = events[i]
            e0.record()
            loss = forward()
            e1.record()
            grad = None if forward_only else torch.autograd.grad(loss, logits)[0]
            e2.record()
            if i == n - 1:
                state["loss"], state["grad"] = loss.detach(), grad  # read after the loop
            del loss, grad
        torch.cuda.synchronize()
        out["cuda_peak_allocated_bytes"] = peak = torch.cuda.max_memory_allocated(dev)
        out["cuda_peak_extra_bytes"] = peak - base
        out["cuda_peak_reserved_extra_bytes"] = torch.cuda.max_memory_reserved(dev) - base_reserved
        for i in range(spec["warmup"], n):
            e0, e1, e2 = events[i]
            fwd_ms.append(e0.elapsed_time(e1))
            bwd_ms.append(e1.elapsed_time(e2))
        grad = state.pop("grad")
        if grad is not None:
            out["grad_aliases_logits"] = grad.data_ptr() == logits.data_ptr()
            out["grad_dtype"] = str(grad.dtype)
            out["grad_norm"] = _chunked_sq_norm(grad)
            out["grad_finite"] = math.isfinite(out["grad_norm"])
        out["loss"] = float(state["loss"])
        del grad
        out["ok"] = True
    except (RuntimeError, MemoryError) as err:  # torch.cuda.OutOfMemoryError is a RuntimeError
        msg = f"{type(err).__name__}: {err}"
        out["ok"] = False
        out["oom"] = isinstance(err, torch.cuda.OutOfMemoryError) or any(m.lower() in msg.lower() for m in OOM_MARKERS)
        out["error"] = msg[:500]
        out["cuda_peak_allocated_bytes_at_failure"] = torch.cuda.max_memory_allocated(dev)
    out["time_fwd_s"] = [round(x / 1e3, 6) for x in fwd_ms]
    out["time_bwd_s"] = [round(x / 1e3, 6) for x in bwd_ms]
    tot = [(f + b) / 1e3 for f, b in zip(fwd_ms, bwd_ms)]
    if tot:
        out["time_total_s"] = {
            "median": round(_median(tot), 6),
            "min": round(min(tot), 6),
            "all": [round(x, 6) for x in tot],
        }
        need = min_bytes_moved(spec["variant"], spec["tokens"], spec["vocab"])
        t_med, f_med, b_med = _median(tot), _median(fwd_ms) / 1e3, _median(bwd_ms) / 1e3
        out["min_bytes_moved"] = need
        out["achieved_bandwidth_GBps"] = {
            "total": need["total"] / t_med / 1e9,
            "forward": need["forward"] / f_med / 1e9 if f_med > 0 else None,
            "backward": need["backward"] / b_med / 1e9 if b_med > 0 else None,
        }
        copy_bw = spec.get("copy_bandwidth_GBps")
        if copy_bw:
            out["fraction_of_copy_bandwidth"] = {
                k: (v / copy_bw if v is not None else None) for k, v in out["achieved_bandwidth_GBps"].items()
            }
    return out


def cuda_copy_bandwidth(nbytes: int, warmup: int = 3, repeats: int = 20) -> dict:
    """Device-to-device ``copy_`` of ``nbytes`` (bf16 random data), timed with CUDA events; bandwidth
    counts the bytes read plus the bytes written."""
    import torch

    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).bfloat16()
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for a, b in events:
        a.record()
        dst.copy_(src)
        b.record()
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in events]
    ok = bool(torch.equal(dst[: 1 << 20], src[: 1 << 20])) and bool(torch.equal(dst[-(1 << 20) :], src[-(1 << 20) :]))
    med = _median(ms) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return {
        "bytes_copied": 2 * n,
        "bytes_counted_read_plus_write": 4 * n,
        "median_s": med,
        "min_s": min(ms) / 1e3,
        "bandwidth_GBps": 4 * n / med / 1e9,
        "best_bandwidth_GBps": 4 * n / (min(ms) / 1e3) / 1e9,
        "repeats": repeats,
        "copy_verified": ok,
    }


# --------------------------------------------------------------------------------------------
# child: small correctness cross-check of the variants (values and gradients)


def child_check(spec: dict) -> dict:
    """ours (tail_grad='reference') vs the plain-torch ema-pg reproduction on small sizes: the loss
    and the gradient must agree; exact_kl vs Top-k KL at k = V (exact head, no tail)."""
    import torch

    res = {}
    base = dict(spec, tokens=64, vocab=2048, k=8, variant="naive_emapg", tail_grad="reference")
    inp = _make_inputs(base)
    outs = {}
    for variant in ("naive_emapg", "naive_logsoftmax", "ours_vp", "ours_core_novalidate"):
        fwd = _build_forward(dict(base, variant=variant, chunk_size=16), inp)  # same inputs for all
        loss = fwd()
        (g,) = torch.autograd.grad(loss, inp["logits"])
        outs[variant] = (float(loss), g.float())
    ref_loss, ref_g = outs["naive_emapg"]
    for variant, (loss, g) in outs.items():
        res[variant] = {
            "loss": loss,
            "loss_abs_diff_vs_naive_emapg": abs(loss - ref_loss),
            "grad_max_abs_diff_vs_naive_emapg": float((g - ref_g).abs().max()),
            "grad_max_abs": float(ref_g.abs().max()),
        }
    # exact_kl == Top-k KL with q = all ids (k = V, no tail) on bf16 logits
    from megatron_empg.core.logprob import exact_kl, full_log_softmax
    from megatron_empg.parallel.vocab_parallel import vocab_parallel_topk_kl

    T, V = 32, 512
    dev = torch.device(spec.get("device", "cpu"))  # drawn on the CPU, then moved (GPU mode)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(T, V, generator=gen).mul_(2).bfloat16()
    r = (z.float() + torch.randn(T, V, generator=gen)).bfloat16().to(dev)
    z = z.to(dev).requires_grad_(True)
    ex = exact_kl(z, r, direction="reverse")
    q = torch.arange(V, device=dev).expand(T, V).contiguous()
    tok = torch.randint(0, V, (T,), generator=gen).to(dev)
    lr = full_log_softmax(r)
    kl, _ = vocab_parallel_topk_kl(
        z,
        tok,
        q,
        lr,
        lr.gather(-1, tok[:, None]).squeeze(-1),
        vocab_start=0,
        vocab_size=V,
        tp_group=None,
        direction="reverse",
        chunk_size=8,
    )
    res["exact_kl_vs_ours_k_eq_V"] = {"max_abs_diff": float((ex - kl.values).abs().max()), "max_kl": float(ex.max())}
    tol = 1e-4
    res["ok"] = (
        all(
            v["loss_abs_diff_vs_naive_emapg"] < tol
            and v["grad_max_abs_diff_vs_naive_emapg"] < 1e-2 * max(v["grad_max_abs"], 1e-30)
            for k_, v in res.items()
            if isinstance(v, dict) and "loss" in v
        )
        and res["exact_kl_vs_ours_k_eq_V"]["max_abs_diff"] < tol
    )
    if dev.type != "cpu":
        res["device"] = str(dev)
    res["note"] = (
        "tokens=64, V=2048, k=8, bf16 logits, chunk_size=16, tail_grad='reference' (the ema-pg surrogate); "
        "gradients are bf16, compared relative to their max (tol 1e-2); losses to 1e-4; "
        "exact_kl vs vocab_parallel_topk_kl with k = V (T=32, V=512)"
    )
    return res


# --------------------------------------------------------------------------------------------
# TP part: spawned gloo ranks that count the bytes of every collective


COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_gather_object",
    "broadcast_object_list",
)


def _install_counters(dist, log: list) -> None:
    """Wrap torch.distributed's collectives (module attributes, as vocab_parallel calls them)."""
    import torch

    def nbytes(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(t) for t in x)
        return 0

    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None or getattr(orig, "_counted", False):
            continue

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            entry = {"op": _name}
            if _name == "all_gather":
                out_list = args[0] if args else kwargs["tensor_list"]
                tensor = args[1] if len(args) > 1 else kwargs["tensor"]
                entry.update(
                    sent_bytes=nbytes(tensor),
                    received_bytes=nbytes(out_list),
                    shape=list(tensor.shape),
                    dtype=str(tensor.dtype),
                )
            else:
                entry["arg_bytes"] = sum(nbytes(a) for a in args)
            log.append(entry)
            return _orig(*args, **kwargs)

        wrapper._counted = True
        setattr(dist, name, wrapper)


def tp_worker(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    log: list = []
    _install_counters(dist, log)
    try:
        from megatron_empg.core.logprob import gather_logprobs, topk_logprobs
        from megatron_empg.core.topk_kl import topk_kl
        from megatron_empg.parallel.vocab_parallel import (
            vocab_parallel_logprobs,
            vocab_parallel_topk,
            vocab_parallel_topk_kl,
        )

        T, V, K = spec["tokens"], spec["vocab"], spec["k"]
        chunk = spec["chunk_size"]
        v_local = -(-V // world)  # padded vocabulary: world * v_local >= V
        start = rank * v_local
        n_valid = max(0, min(v_local, V - start))
        inp = _make_inputs(dict(spec, variant="ours_vp"))
        full = inp["logits"].detach()
        shard = torch.zeros(T, v_local, dtype=full.dtype)
        shard[:, :n_valid] = full[:, start : start + n_valid]
        token, q, old = inp["token"], inp["q"], inp["old_logprobs"]
        ha, an = inp["head_anchor_logprobs"], inp["anchor_logprobs"]
        kw = dict(vocab_start=start, vocab_size=V, tp_group=dist.group.WORLD, chunk_size=chunk)
        res = {"rank": rank, "world": world, "v_local": v_local, "n_valid": n_valid, "passes": {}}

        def count(fn):
            log.clear()
            out = fn()
            entries = list(log)
            ag = [e for e in entries if e["op"] == "all_gather"]
            return out, {
                "calls": [{k: v for k, v in e.items()} for e in entries],
                "all_gather_sent_bytes": sum(e["sent_bytes"] for e in ag),
                "all_gather_received_bytes": sum(e["received_bytes"] for e in ag),
                "other_collective_calls": sum(1 for e in entries if e["op"] != "all_gather"),
            }

        # update pass: Top-k KL forward (one all-gather inside vocab_parallel_logprobs) + backward
        logits = shard.clone().requires_grad_(True)
        (kl, lp), c_fwd = count(
            lambda: vocab_parallel_topk_kl(logits, token, q, ha, an, direction="reverse", old_logprobs=old, **kw)
        )
        loss = kl.values.mean()
        (grad,), c_bwd = count(lambda: torch.autograd.grad(loss, logits))
        res["passes"]["update_topk_kl_forward"] = c_fwd
        res["passes"]["update_topk_kl_backward"] = c_bwd
        # single-device reference on the full vocabulary
        full_l = full.clone().requires_grad_(True)
        kl_ref = topk_kl(full_l, token, q, ha, an, direction="reverse", old_logprobs=old, chunk_size=chunk)
        (g_ref,) = torch.autograd.grad(kl_ref.values.mean(), full_l)
        res["check_update"] = {
            "loss_abs_diff": abs(float(loss) - float(kl_ref.values.mean())),
            "grad_max_abs_diff": float(
                (grad[:, :n_valid].float() - g_ref[:, start : start + n_valid].float()).abs().max()
            )
            if n_valid
            else 0.0,
            "grad_max_abs": float(g_ref.float().abs().max()),
            "padding_grad_max_abs": float(grad[:, n_valid:].float().abs().max()) if n_valid < v_local else 0.0,
        }
        # anchor pass on the reference logits: log-probs at the K+1 ids, no grad
        ids = torch.cat([q, token[:, None]], -1)
        with torch.no_grad():
            (lp_anchor, _), c_anchor = count(lambda: vocab_parallel_logprobs(shard, ids, **kw))
        res["passes"]["anchor_logprobs_k_plus_1"] = c_anchor
        res["check_anchor"] = {"max_abs_diff": float((lp_anchor - gather_logprobs(full, ids)).abs().max())}
        # old-policy / anchor top-k pass
        (tv, ti), c_topk = count(lambda: vocab_parallel_topk(shard, K, **kw))
        res["passes"]["topk"] = c_topk
        rv, ri = topk_logprobs(full, K)
        res["check_topk"] = {"ids_equal": bool(torch.equal(ti, ri)), "max_abs_diff": float((tv - rv).abs().max())}

        # baseline: an actual full-vocab fp32 all-gather of the logits shard
        def gather_full():
            parts = [torch.empty(T, v_local) for _ in range(world)]
            dist.all_gather(parts, shard.float())
            return torch.cat(parts, -1)[:, :V]

        gathered, c_full = count(gather_full)
        res["passes"]["full_vocab_fp32_all_gather"] = c_full
        res["check_full_gather"] = {"equal": bool(torch.equal(gathered, full.float()))}
        for p in res["passes"].values():
            p["sent_bytes_per_token"] = p["all_gather_sent_bytes"] / T
            p["received_bytes_per_token"] = p["all_gather_received_bytes"] / T
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    except Exception:  # noqa: BLE001 - reported to the parent through the rank's file
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "error": traceback.format_exc()[-3000:]}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_tp(spec: dict) -> dict:
    import torch.multiprocessing as mp

    world = spec["world"]
    with tempfile.TemporaryDirectory(prefix="topk_kl_tp_") as tmp:
        port = _free_port()
        mp.spawn(tp_worker, args=(world, port, spec, tmp), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"world": world, "ok": False, "error": errors[0]}
    V, K = spec["vocab"], spec["k"]
    r0 = ranks[0]
    summary = {}
    for name, p in r0["passes"].items():
        summary[name] = {
            "sent_bytes_per_token_per_rank": p["sent_bytes_per_token"],
            "gathered_bytes_per_token": p["received_bytes_per_token"],
            "all_gather_calls": sum(1 for c in p["calls"] if c["op"] == "all_gather"),
            "other_collective_calls": p["other_collective_calls"],
            "same_on_all_ranks": all(
                rk["passes"][name]["all_gather_sent_bytes"] == p["all_gather_sent_bytes"] for rk in ranks
            ),
        }
    full = summary["full_vocab_fp32_all_gather"]["gathered_bytes_per_token"]
    for name, s in summary.items():
        s["fraction_of_full_vocab_fp32"] = s["gathered_bytes_per_token"] / full if full else None
    checks = {
        "update_loss_abs_diff_max": max(r["check_update"]["loss_abs_diff"] for r in ranks),
        "update_grad_max_abs_diff": max(r["check_update"]["grad_max_abs_diff"] for r in ranks),
        "update_grad_max_abs": r0["check_update"]["grad_max_abs"],
        "padding_grad_max_abs": max(r["check_update"]["padding_grad_max_abs"] for r in ranks),
        "anchor_logprobs_max_abs_diff": max(r["check_anchor"]["max_abs_diff"] for r in ranks),
        "topk_ids_equal": all(r["check_topk"]["ids_equal"] for r in ranks),
        "topk_max_abs_diff": max(r["check_topk"]["max_abs_diff"] for r in ranks),
        "full_gather_equal": all(r["check_full_gather"]["equal"] for r in ranks),
    }
    return {
        "world": world,
        "ok": True,
        "tokens": spec["tokens"],
        "v_local": r0["v_local"],
        "expected_bytes_per_token": {
            "update_pass_packed_fp32_(1+K+1)": (1 + K + 1) * 4,  # lse, logits at q and y (no entropy)
            "anchor_pass_packed_fp32_(2+K+1)": (2 + K + 1) * 4,  # + the entropy term
            "topk_packed_fp32_(1+2k)": (1 + 2 * K) * 4,
            "full_vocab_fp32_V*4": V * 4,
            "note": "per rank sent; the gathered result per token is world times that (full vocab: world*v_local*4 incl. padding)",
        },
        "measured": summary,
        "checks_vs_single_device": checks,
        "per_rank_calls_rank0": {name: p["calls"] for name, p in r0["passes"].items()},
    }


# --------------------------------------------------------------------------------------------
# parent: orchestration (never imports torch)


def run_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps(spec)]
    env = dict(os.environ)
    if spec.get("threads"):
        env.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout} s", **_spec_keys(spec)}
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        killed = proc.returncode < 0
        return {
            "ok": False,
            "oom": killed and -proc.returncode == 9,
            "error": f"child exited with {proc.returncode}: {proc.stderr.strip()[-1500:]}",
            **_spec_keys(spec),
        }
    res = json.loads(lines[-1])
    res["child_wall_s"] = round(wall, 2)
    return res


def _spec_keys(spec: dict) -> dict:
    return {k: spec[k] for k in ("variant", "tokens", "chunk_size", "world") if k in spec}


def _fmt_bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def _summary_line(r: dict) -> str:
    if not r.get("ok"):
        oom = " (OOM)" if r.get("oom") else ""
        return f"  {r.get('variant', r.get('kind')):<30} T={r.get('tokens')} FAILED{oom}: {r.get('error', '')[:200]}"
    t = r["time_total_s"]
    if "cuda_peak_extra_bytes" in r:  # GPU mode
        frac = (r.get("fraction_of_copy_bandwidth") or {}).get("total")
        return (
            f"  {r['variant']:<30} T={r['tokens']:<6} chunk={r['chunk_size']:<5} time median {t['median'] * 1e3:.3f} ms "
            f"(fwd {_median(r['time_fwd_s']) * 1e3:.3f}, bwd {_median(r['time_bwd_s']) * 1e3:.3f}) "
            f"peak+ {_fmt_bytes(r['cuda_peak_extra_bytes'])} "
            f"{r['achieved_bandwidth_GBps']['total']:.0f} GB/s"
            + (f" ({100 * frac:.0f}% of copy)" if frac is not None else "")
            + f" loss {r['loss']:.6g}"
        )
    return (
        f"  {r['variant']:<30} T={r['tokens']:<6} chunk={r['chunk_size']:<5} time median {t['median']:.3f} s "
        f"(fwd {sorted(r['time_fwd_s'])[len(r['time_fwd_s']) // 2]:.3f}, bwd {sorted(r['time_bwd_s'])[len(r['time_bwd_s']) // 2]:.3f}) "
        f"rss+ {_fmt_bytes(r['peak_rss_extra_bytes'])} tracked+ {_fmt_bytes(r.get('tracked_peak_bytes'))} "
        f"loss {r['loss']:.6g}"
    )


def _ratios(ours: dict, naive: dict, same_quantity: bool = True) -> dict:
    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    t = ratio(ours["time_total_s"]["median"], naive["time_total_s"]["median"])
    if "cuda_peak_extra_bytes" in ours:  # GPU mode: the CUDA allocator's peak above the inputs
        m_cuda = ratio(ours["cuda_peak_extra_bytes"], naive.get("cuda_peak_extra_bytes"))
        return {
            "tokens": ours["tokens"],
            "time_median_ratio": t,
            "time_min_ratio": ratio(ours["time_total_s"]["min"], naive["time_total_s"]["min"]),
            "peak_extra_mem_ratio_cuda": m_cuda,
            "target_mem_le_0.1x_met": None if m_cuda is None else m_cuda <= 0.1,
            "target_time_le_0.5x_met": None if t is None else t <= 0.5,
            "loss_abs_diff": abs(ours["loss"] - naive["loss"]) if same_quantity else None,
        }
    m_tr = ratio(ours.get("tracked_peak_bytes"), naive.get("tracked_peak_bytes"))
    m_rss = ratio(ours["peak_rss_extra_bytes"], naive["peak_rss_extra_bytes"])
    primary = m_tr if m_tr is not None else m_rss
    return {
        "tokens": ours["tokens"],
        "time_median_ratio": t,
        "time_min_ratio": ratio(ours["time_total_s"]["min"], naive["time_total_s"]["min"]),
        "peak_extra_mem_ratio_tracked": m_tr,
        "peak_extra_mem_ratio_rss": m_rss,
        "target_mem_le_0.1x_met": None if primary is None else primary <= 0.1,
        "target_time_le_0.5x_met": None if t is None else t <= 0.5,
        # the same loss value up to rounding when both compute the Top-k KL of the same inputs
        "loss_abs_diff": abs(ours["loss"] - naive["loss"]) if same_quantity else None,
    }


def _overhead(path: dict, bare: dict) -> dict:
    """``_ratios`` of the trainer's update pass to the bare function, with this comparison's target
    (within 10% in time and in peak extra memory) in place of the ours/naive ones."""
    r = {k: v for k, v in _ratios(path, bare, same_quantity=False).items() if not k.startswith(("target_", "loss_"))}
    keys = ("peak_extra_mem_ratio_cuda", "peak_extra_mem_ratio_tracked", "peak_extra_mem_ratio_rss")
    mem = next((r[k] for k in keys if r.get(k) is not None), None)
    t = r["time_median_ratio"]
    r["target_within_1.1x_met"] = None if t is None or mem is None else t <= 1.1 and mem <= 1.1
    return r


def _trainer_path(tokens: int, results: dict[str, dict]) -> dict:
    """The trainer's rows measured at ``tokens`` (``TRAINER_GROUP``; results: variant -> child
    result) and the ratios of its update pass to the bare function and to the naive pipeline."""
    rows = {v: r for v, r in results.items() if v in TRAINER_GROUP and r["tokens"] == tokens}
    out = {"tokens": tokens, "rows": {}, "ratios": {}}
    for v, r in rows.items():
        out["rows"][v] = {
            "time_median_s": r["time_total_s"]["median"],
            "time_fwd_median_s": _median(r["time_fwd_s"]),
            "time_bwd_median_s": _median(r["time_bwd_s"]),
            "peak_extra_bytes": r.get("cuda_peak_extra_bytes", r.get("tracked_peak_bytes")),
            "peak_rss_extra_bytes": r.get("peak_rss_extra_bytes"),
        }
    for path in ("ours_rl_loss", "ours_rl_loss_noentropy"):
        if path in rows and "ours_vp_inplace" in rows:
            out["ratios"][f"{path}/ours_vp_inplace"] = _overhead(rows[path], rows["ours_vp_inplace"])
        if path in rows and "naive_emapg" in rows:
            out["ratios"][f"{path}/naive_emapg"] = _ratios(rows[path], rows["naive_emapg"], same_quantity=False)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=None, help="default: megatron_empg's DEFAULT_CHUNK_SIZE")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tp", default="1,2,4", help="comma list; sizes > 1 run the all-gather byte count")
    p.add_argument("--tp-tokens", type=int, default=256)
    p.add_argument(
        "--out",
        default=None,
        help="default benchmarks/results/topk_kl_cpu.json (--device cpu) or topk_kl_gpu.json (cuda)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: GPU mode (CUDA events, allocator peak, bandwidth vs a measured copy; no TP part)",
    )
    p.add_argument(
        "--copy-gb",
        type=float,
        default=2.0,
        help="GPU mode: GiB copied by the device-to-device copy that gives the reference bandwidth",
    )
    p.add_argument("--variants", default=",".join(MAIN_VARIANTS))
    p.add_argument("--min-tokens", type=int, default=512, help="lowest token count tried after an OOM")
    p.add_argument(
        "--sweep-tokens",
        type=int,
        default=None,
        help="tokens of the chunk-size sweep (default min(2048, --tokens)); 0 disables it",
    )
    p.add_argument("--sweep-chunks", default="256,512,1024,2048")
    p.add_argument("--sweep-variants", default="ours_vp_inplace,ours_core_novalidate")
    p.add_argument("--tail-grad", default="unbiased", choices=("unbiased", "reference"))
    p.add_argument(
        "--trainer-tokens",
        default="",
        help="comma list of further token counts at which the trainer's path (TRAINER_GROUP) is measured",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch default)")
    p.add_argument(
        "--mem-limit-gb",
        type=float,
        default=None,
        help="extra-memory budget per child: RLIMIT_AS = virtual size after the inputs + budget "
        "+ 1 GiB slack for virtual reservations; default budget: MemAvailable - 1 GiB",
    )
    p.add_argument("--no-tracked", action="store_true", help="skip the torch.profiler memory run")
    p.add_argument("--no-check", action="store_true", help="skip the small correctness cross-check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-scale", type=float, default=2.0)
    p.add_argument("--child-timeout", type=float, default=3600.0)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _child_entry(spec: dict) -> None:
    kind = spec.get("kind", "bench")
    try:
        if kind == "bench":
            res = child_bench_cuda(spec) if spec.get("device") == "cuda" else child_bench(spec)
        elif kind == "check":
            res = child_check(spec)
        elif kind == "tp":
            res = child_tp(spec)
        elif kind == "info":
            import torch

            res = {
                "torch_version": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
                "default_chunk_size": __import__("megatron_empg.core.logprob", fromlist=["x"]).DEFAULT_CHUNK_SIZE,
                "mkldnn": torch.backends.mkldnn.is_available(),
                "cuda": torch.cuda.is_available(),
            }
            if spec.get("device") == "cuda":
                props = torch.cuda.get_device_properties(0)
                res.update(
                    torch_cuda_version=torch.version.cuda,
                    device_name=props.name,
                    device_total_memory_bytes=props.total_memory,
                    multiprocessors=props.multi_processor_count,
                    capability=list(torch.cuda.get_device_capability(0)),
                    l2_cache_bytes=getattr(props, "L2_cache_size", None),
                    copy_bandwidth=cuda_copy_bandwidth(int(spec["copy_gb"] * 2**30)),
                )
        else:
            raise ValueError(kind)
    except Exception:  # noqa: BLE001 - the parent records it
        res = {"ok": False, "error": traceback.format_exc()[-3000:], **_spec_keys(spec)}
    print(json.dumps(res), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._child is not None:
        _child_entry(json.loads(args._child))
        return 0
    if args.sweep_tokens is None:
        args.sweep_tokens = min(2048, args.tokens)
    cuda = args.device == "cuda"
    if args.out is None:
        args.out = str(REPO / f"benchmarks/results/topk_kl_{'gpu' if cuda else 'cpu'}.json")
    t_start = time.perf_counter()
    variants = [v for v in args.variants.split(",") if v]
    unknown = (set(variants) | set(x for x in args.sweep_variants.split(",") if x)) - set(MAIN_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {MAIN_VARIANTS}")
    info = run_child({"kind": "info", "device": "cuda", "copy_gb": args.copy_gb} if cuda else {"kind": "info"}, 600)
    if cuda and not info.get("cuda"):
        raise SystemExit(f"--device cuda, but the child sees no CUDA device: {json.dumps(info)[:1500]}")
    chunk = args.chunk_size or info.get("default_chunk_size", 1024)
    base = {
        "kind": "bench",
        "vocab": args.vocab,
        "k": args.k,
        "seed": args.seed,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "tail_grad": args.tail_grad,
        "threads": args.threads,
        "tracked": not args.no_tracked,
        "logit_scale": args.logit_scale,
        "ref_noise": 0.5,
        "mem_budget": None if args.mem_limit_gb is None else int(args.mem_limit_gb * 2**30),
    }
    if cuda:
        base.update(device="cuda", copy_bandwidth_GBps=info["copy_bandwidth"]["bandwidth_GBps"])
    report = {
        "benchmark": "topk_kl",
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "torch": info,
        "git": git_info(),
        "params": {k: v for k, v in vars(args).items() if k != "_child" and (cuda or k not in GPU_ONLY_ARGS)}
        | {"chunk_size_used": chunk},
        "method": {
            "process": "each (variant, tokens, chunk) in a fresh subprocess (python benchmarks/topk_kl.py --_child ...); "
            "inputs generated chunk-wise (no [T,V] fp32 transient), then gc, then the RSS baseline",
            "loss": "mean over tokens of the per-token Top-k KL value (reverse, q = top-k of pi_old, sampled tail "
            "with importance weight sg(pi/pi_old)); backward = torch.autograd.grad(loss, logits) (no AccumulateGrad copy); "
            "for exact_kl the mean exact KL",
            "inputs": "bf16 logits [T,V] (leaf, requires_grad) + small tensors ([T,k] ids, [T,k] anchor log-probs / "
            "bf16 reference logits_k, [T] lse/log-probs); ref logits [T,V] bf16 only for exact_kl/*_with_ref/*_with_anchor; "
            "inplace variants also hold a pristine [T,V] bf16 copy to restore the logits between repeats (outside timing)",
            "time": "perf_counter wall time of forward (loss) and backward (autograd.grad) per repeat after warmup; "
            "median and min over repeats; noisy on a shared machine (see loadavg fields)",
            "peak_rss_extra_bytes": "VmHWM after resetting it with 'echo 5 > /proc/self/clear_refs' right after the "
            "inputs, minus VmRSS at that point; covers warmup + repeats (falls back to ru_maxrss if the reset fails)",
            "ru_maxrss_extra_bytes": "getrusage(RUSAGE_SELF).ru_maxrss minus VmRSS after the inputs (the reset also "
            "resets ru_maxrss on Linux)",
            "tracked_peak_bytes": "peak of the running sum of CPU allocator events recorded by torch.profiler("
            "profile_memory=True) during one extra forward+backward: bytes allocated above everything alive before "
            "(i.e. above the inputs); the primary memory number of the ratios",
            "rlimit": "each bench child sets RLIMIT_AS = its virtual size after the inputs + budget + 1 GiB, so that an "
            "oversized variant fails with an allocation error instead of triggering the OOM killer; on OOM the "
            "comparison is retried at half the tokens (down to --min-tokens)",
        },
        "variants": {v: VARIANT_DOC[v] for v in variants},
        "results": [],
    }
    if cuda:
        report["method"] = {**report["method"], **CUDA_METHOD}
        for key in ("peak_rss_extra_bytes", "ru_maxrss_extra_bytes", "tracked_peak_bytes", "rlimit"):
            report["method"].pop(key)
        report["device_copy_bandwidth"] = info["copy_bandwidth"]
        cb = info["copy_bandwidth"]
        print(
            f"{info.get('device_name')}: torch {info.get('torch_version')} (CUDA {info.get('torch_cuda_version')}); "
            f"device-to-device copy {cb['bandwidth_GBps']:.0f} GB/s (read + write, "
            f"{cb['bytes_copied'] / 2**30:.1f} GiB copied, median of {cb['repeats']}); chunk {chunk}",
            flush=True,
        )
    else:
        print(f"torch {info.get('torch_version')} threads {info.get('torch_threads')}; chunk {chunk}", flush=True)

    if not args.no_check:
        check = run_child({**base, "kind": "check"}, args.child_timeout)
        report["cross_check"] = check
        print(
            f"cross-check ok={check.get('ok')}: "
            + json.dumps({k: v for k, v in check.items() if k not in ("note",)})[:800],
            flush=True,
        )

    # main comparison. The ours/naive variants and the trainer's path run at one token count (the
    # trainer's path right after the bare function: the ratio of neighbours on a shared machine):
    # when one of them fails with an allocation error, all of them are rerun at half the tokens
    # (down to --min-tokens). The other variants (exact_kl, *_with_ref/anchor) start at that count
    # and halve on their own.
    def write_partial() -> None:  # GPU mode: a run cut short by a time limit still leaves its results
        if cuda:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**report, "partial": True}, indent=1) + "\n")

    def attempt(v: str, tokens: int) -> dict:
        r = run_child({**base, "variant": v, "tokens": tokens, "chunk_size": chunk}, args.child_timeout)
        report["results"].append(r)
        print(_summary_line(r), flush=True)
        write_partial()
        return r

    critical = [v for v in variants if v in OURS + NAIVE + TRAINER_GROUP]
    others = [v for v in variants if v not in critical]
    tokens = args.tokens
    main_results: dict[str, dict] = {}
    while critical:
        print(f"main comparison at tokens={tokens}:", flush=True)
        runs = {v: attempt(v, tokens) for v in critical}
        main_results = {v: r for v, r in runs.items() if r.get("ok")}
        failed = [r for r in runs.values() if not r.get("ok")]
        if not failed or not any(r.get("oom") for r in failed) or tokens // 2 < args.min_tokens:
            break
        tokens //= 2
        print(f"allocation failure: retrying the ours/naive variants at tokens={tokens}", flush=True)
    for v in others:
        t = tokens
        while True:
            r = attempt(v, t)
            if r.get("ok") or not r.get("oom") or t // 2 < args.min_tokens:
                break
            t //= 2
        if r.get("ok"):
            main_results[v] = r

    comparison = {"tokens": tokens, "ratios": {}}
    pairs = [(o, n) for o in OURS for n in NAIVE + ("exact_kl",)]
    pairs.append(("ours_vp_inplace_with_anchor", "naive_emapg_with_ref"))
    for o, n in pairs:
        ro, rn = main_results.get(o), main_results.get(n)
        if ro and rn and ro["tokens"] == rn["tokens"]:
            comparison["ratios"][f"{o}/{n}"] = _ratios(ro, rn, same_quantity=n != "exact_kl")
    key = "ours_vp_inplace/naive_emapg"
    if key in comparison["ratios"]:
        comparison["headline"] = {"pair": key, **comparison["ratios"][key]}
    comparison["targets"] = (
        "ours peak extra memory <= 0.1x naive (tracked allocations; RSS ratio also given), time <= 0.5x"
    )
    report["comparison"] = comparison

    # the trainer's path: its rows at --tokens (above) and at every --trainer-tokens count
    group = [v for v in TRAINER_GROUP if v in variants]
    by_tokens = {tokens: main_results}
    extra_tokens = sorted({int(x) for x in args.trainer_tokens.split(",") if x} - {tokens})
    if group and extra_tokens:
        report["trainer_sweep"] = []
        for t in extra_tokens:
            print(f"trainer path at tokens={t}:", flush=True)
            by_tokens[t] = {}
            for v in group:
                r = run_child({**base, "variant": v, "tokens": t, "chunk_size": chunk}, args.child_timeout)
                report["trainer_sweep"].append(r)
                write_partial()
                print(_summary_line(r), flush=True)
                if r.get("ok"):
                    by_tokens[t][v] = r
    if group:
        comparison["trainer_path"] = [_trainer_path(t, rs) for t, rs in sorted(by_tokens.items())]
        comparison["trainer_path_target"] = "ours_rl_loss within 1.1x of ours_vp_inplace in time and peak extra memory"

    # chunk-size sweep
    if args.sweep_tokens > 0:
        report["chunk_sweep"] = []
        print(f"chunk sweep (tokens={args.sweep_tokens}):", flush=True)
        for v in [x for x in args.sweep_variants.split(",") if x]:
            for c in [int(x) for x in args.sweep_chunks.split(",") if x]:
                r = run_child({**base, "variant": v, "tokens": args.sweep_tokens, "chunk_size": c}, args.child_timeout)
                report["chunk_sweep"].append(r)
                write_partial()
                print(_summary_line(r), flush=True)

    # TP all-gather bytes
    report["tp"] = []
    for world in [int(x) for x in args.tp.split(",") if x]:
        if world <= 1:
            continue
        if cuda:
            report["tp_skipped"] = "the TP part runs on CPU/gloo only; not run with --device cuda"
            print(f"TP={world}: skipped on CUDA (gloo/CPU only)", flush=True)
            continue
        r = run_child(
            {**base, "kind": "tp", "world": world, "tokens": args.tp_tokens, "chunk_size": chunk},
            args.child_timeout,
        )
        report["tp"].append(r)
        if r.get("ok"):
            m = r["measured"]
            print(
                f"TP={world}: bytes/token sent per rank: update {m['update_topk_kl_forward']['sent_bytes_per_token_per_rank']:.0f} "
                f"(+bwd {m['update_topk_kl_backward']['sent_bytes_per_token_per_rank']:.0f}), "
                f"anchor {m['anchor_logprobs_k_plus_1']['sent_bytes_per_token_per_rank']:.0f}, "
                f"topk {m['topk']['sent_bytes_per_token_per_rank']:.0f}, "
                f"full fp32 {m['full_vocab_fp32_all_gather']['sent_bytes_per_token_per_rank']:.0f}; "
                f"checks {r['checks_vs_single_device']}",
                flush=True,
            )
        else:
            print(f"TP={world} FAILED: {r.get('error', '')[-800:]}", flush=True)

    report["machine"]["loadavg_at_end"] = _loadavg()
    report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    h = comparison.get("headline")
    if h and cuda:
        print(
            f"headline {h['pair']} at T={h['tokens']}: time x{h['time_median_ratio']:.3f} "
            f"(target <=0.5: {h['target_time_le_0.5x_met']}), peak extra mem (CUDA allocator) "
            f"x{h['peak_extra_mem_ratio_cuda']} (target <=0.1: {h['target_mem_le_0.1x_met']})"
        )
    elif h:
        print(
            f"headline {h['pair']} at T={h['tokens']}: time x{h['time_median_ratio']:.3f} "
            f"(target <=0.5: {h['target_time_le_0.5x_met']}), peak extra mem tracked x{h['peak_extra_mem_ratio_tracked']} "
            f"rss x{h['peak_extra_mem_ratio_rss']:.3f} (target <=0.1: {h['target_mem_le_0.1x_met']})"
        )
    for entry in comparison.get("trainer_path", []):
        for pair, r in entry["ratios"].items():
            mem = next((r[k] for k in ("peak_extra_mem_ratio_cuda", "peak_extra_mem_ratio_tracked") if r.get(k)), None)
            print(f"trainer path T={entry['tokens']} {pair}: time x{r['time_median_ratio']:.3f}, peak extra mem x{mem}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
