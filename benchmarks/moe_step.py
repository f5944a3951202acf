"""The mixture-of-experts measurement inside ``benchmarks/train_step.py``'s RL step (its docstring
describes the method and the record): the MoE blocks' own time (``MoeBlockTimer``: a marker at
each ``MoELayer`` call's forward and backward start and end), their FLOPs (``moe_block_flops``: the
router and the top-k experts' GEMMs), a record's MoE fields (``moe_record``), grouped against
sequential experts (``moe_comparison``) and issue 44's goals (``moe_goals``). ``train_step.py``
imports this module; it imports no other benchmark.
"""

from __future__ import annotations

import statistics
import time

import torch

CUDA = torch.cuda.is_available()
MOE_LAYERS = 4  # a mixture of experts' layers unless --num-layers / num_layers= says otherwise


class MoeBlockTimer:
    """The MoE blocks' own time inside the step (``train_step.py``'s docstring): on every
    ``MoELayer`` of ``models``, a marker (a CUDA event; ``time.perf_counter`` on CPU) at each call's
    forward start and end (module hooks) and at its backward start and end (tensor hooks on the
    gradients of its output and its input). ``collect()`` after a synchronize: the seconds of the
    calls since the last collect, forward and backward."""

    METHOD = (
        "cuda events (perf_counter on CPU) at each MoELayer call's forward start/end (module forward pre-/post-"
        "hooks) and backward start/end (tensor hooks on the gradients of its output and of its input), summed "
        "over layers, micro-batches and passes inside the timed steps; median over the repeats"
    )

    def __init__(self, models) -> None:
        self.calls: list[dict] = []
        self.handles = []
        self.layers = 0
        for chunk in models:
            for module in chunk.modules():
                if any(c.__name__ == "MoELayer" for c in type(module).__mro__):
                    self.layers += 1
                    self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                    self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    @staticmethod
    def _mark():
        if CUDA:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def _seconds(start, end) -> float:
        return start.elapsed_time(end) / 1e3 if CUDA else end - start

    def _pre(self, module, args, kwargs):
        call = {"forward_start": self._mark()}
        x = args[0] if args else kwargs.get("hidden_states")
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda _grad: call.__setitem__("backward_end", self._mark()))
        module._bench_moe_call = call
        self.calls.append(call)

    def _post(self, module, args, kwargs, output):
        call = module._bench_moe_call
        call["forward_end"] = self._mark()
        y = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda _grad: call.__setitem__("backward_start", self._mark()))

    def collect(self) -> dict[str, float]:
        out = {"forward": 0.0, "backward": 0.0}
        for call in self.calls:
            if "forward_end" in call:
                out["forward"] += self._seconds(call["forward_start"], call["forward_end"])
            if "backward_start" in call and "backward_end" in call:
                out["backward"] += self._seconds(call["backward_start"], call["backward_end"])
        self.calls = []
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def moe_block_flops(model_cfg, tokens: int, passes: int, step_flops_causal: float) -> dict:
    """The MoE blocks' FLOPs in a step of ``tokens`` tokens and ``passes`` forward-pass equivalents
    (router E h and the top-k experts' 3 h F per token and layer), and their share of the step's."""
    moe_params = model_cfg.num_layers * (
        model_cfg.num_experts * model_cfg.hidden_size + model_cfg.moe_router_topk * model_cfg.expert_parameters()
    )
    return {
        "moe_block_active_params": moe_params,
        "moe_block_step_flops": passes * 2 * moe_params * tokens,
        "moe_block_share_of_step_flops": passes * 2 * moe_params * tokens / step_flops_causal,
        "moe_block_formula": "5 x 2 tokens x layers x (router E h + top-k x 3 h F); no attention, no output layer",
    }


def moe_modules(policy) -> tuple[str | None, str | None]:
    """The classes of the first MoE layer's experts (GroupedExperts, SequentialMLP, ...) and token
    dispatcher (LocalTokenDispatcher, MoEAlltoAllTokenDispatcher, ...)."""
    for chunk in policy:
        for name, module in chunk.named_modules():
            if name.endswith("mlp.experts"):
                dispatcher = getattr(chunk.get_submodule(name.rsplit(".", 1)[0]), "token_dispatcher", None)
                return type(module).__name__, type(dispatcher).__name__
    return None, None


def moe_record(
    model_cfg, policy, parallel, timer: MoeBlockTimer, times: list[dict[str, float]], flops: dict, step_s: float, peak
) -> dict:
    """A record's MoE fields: the MoE blocks' seconds per timed step (``times``: seconds per pass,
    from ``timer``) as medians, their share of the step and MFU (``peak``: TFLOP/s or None), what
    ran (experts module, EP, dispatcher)."""
    moe_medians = {k: statistics.median(t[k] for t in times) for k in times[0]}
    moe_s = statistics.median(sum(t.values()) for t in times)
    experts, dispatcher = moe_modules(policy)
    return {
        "moe_experts": model_cfg.moe_experts,
        "moe_experts_module": experts,
        "token_dispatcher_module": dispatcher,
        "moe_layer_modules_hooked": timer.layers,  # the policy's and the anchor's MoELayer modules
        "moe_block_timing": MoeBlockTimer.METHOD,
        "moe_block_seconds": moe_s,
        "moe_block_seconds_median_by_pass": moe_medians,
        "moe_block_share_of_step_time": moe_s / step_s,
        "moe_block_achieved_tflops": flops["moe_block_step_flops"] / moe_s / 1e12 if moe_s else None,
        "moe_block_mfu": flops["moe_block_step_flops"] / moe_s / 1e12 / peak if peak and moe_s else None,
        "expert_parallel": parallel.expert_model_parallel_size,
        "token_dispatcher": getattr(policy[0].config, "moe_token_dispatcher_type", None),
        "all_to_all": "none: one GPU at EP 1, the dispatcher permutes the tokens locally",
    }


def moe_summary(record: dict) -> str:
    """The MoE blocks' part of a record's summary line ("" without them)."""
    if record.get("moe_block_seconds") is None:
        return ""
    mfu = record.get("moe_block_mfu")
    return f", MoE blocks {record['moe_block_seconds'] * 1e3:.0f} ms" + (
        f" ({100 * mfu:.1f}% MFU)" if mfu is not None else ""
    )


def moe_comparison(records: list[dict]) -> list[dict]:
    """Grouped against sequential experts for each case that ran with both (same everything else)."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in records:
        if r.get("ok") and r.get("moe_experts"):
            base = r["case"].replace(f" experts={r['moe_experts']}", "")
            by_case.setdefault(base, {})[r["moe_experts"]] = r
    out = []
    for base, runs in by_case.items():
        if "grouped" in runs and "sequential" in runs:
            g, q = runs["grouped"], runs["sequential"]
            out.append(
                {
                    "case": base,
                    "grouped_tokens_per_s": g["tokens_per_s"],
                    "sequential_tokens_per_s": q["tokens_per_s"],
                    "step_speedup": g["tokens_per_s"] / q["tokens_per_s"],
                    "moe_block_speedup": q["moe_block_seconds"] / g["moe_block_seconds"]
                    if g.get("moe_block_seconds")
                    else None,
                    "repeats": {"grouped": g["repeats"], "sequential": q["repeats"]},
                }
            )
    return out


def moe_goals(records: list[dict], comparison: list[dict]) -> dict | None:
    """Issue 44's goals on one H200 without TE, against this run (None without an MoE record)."""
    grouped = [r for r in records if r.get("ok") and r.get("moe_experts") == "grouped"]
    if not grouped:
        return None
    r = grouped[0]

    def goal(value, target, met):
        return {"value": value, "target": target, "met": None if value is None else met(value)}

    speedup = comparison[0]["moe_block_speedup"] if comparison else None
    return {
        "record": r["case"],
        "step_mfu": goal(r.get("mfu"), 0.30, lambda v: v >= 0.30),
        "moe_block_mfu": goal(r.get("moe_block_mfu"), 0.35, lambda v: v >= 0.35),
        "grouped_over_sequential_moe_blocks": goal(speedup, 5.0, lambda v: v >= 5.0),
        "grouped_over_sequential_step": comparison[0]["step_speedup"] if comparison else None,
        "peak_vs_plan": goal(r.get("peak_vs_plan"), 0.05, lambda v: abs(v) <= 0.05),
        "note": "one GPU at EP 1: no all-to-all (the peers' numbers are at EP 8 on 8 to 32 GPUs)",
    }


def print_comparison(comparison: list[dict]) -> None:
    """One line per case of ``moe_comparison``: grouped over sequential, step and MoE blocks."""
    for c in comparison:
        speedup = c["moe_block_speedup"]
        print(
            f"grouped / sequential ({c['case']}): step x{c['step_speedup']:.2f}"
            + (f", MoE blocks x{speedup:.2f}" if speedup else ""),
            flush=True,
        )
