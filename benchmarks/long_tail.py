"""A long tail of response lengths for ``benchmarks/async_overlap.py``, made inside the transformers
engine (``rollout.engine=hf``) of a training run: the demo model's own responses are all about as
short (a few tokens), so a step's rollout has no straggler to hide.

``environment`` writes a ``sitecustomize.py`` into a directory that goes first on the run's
``PYTHONPATH``; every Python process of the run imports it at start-up, and in the torchrun workers
(``RANK`` set) it calls ``install``, which wraps ``HfEngine._decode`` (nothing under
``megatron_empg/`` is changed). In every ``generate`` call of the rollout (not the consistency
gate's probe, which samples with ``ignore_eos``):

* **which responses**: those whose sampling seed s (the engine's per-response seed, ``seed + i * n
  + j``; consecutive over a step's samples and over the engines' shares of it) has s mod M = M - 1:
  one sample in M (``every``), the same ones in every run of the same steps, whatever the placement;
* **how long**: such a response cannot end (its eos and stop token ids get -inf logits, what vLLM's
  ``min_tokens`` does) while any other response of the call is still running, and then runs to
  exactly T = ceil(F x the median length of the call's other responses) tokens (``factor`` F;
  lengths count the final eos), where it ends with ``finish_reason="length"``; T is capped by the
  sampling ``max_tokens`` (raised by the benchmark: ``MAX_TOKENS``) and the context;
* **the others** keep the recipe's ``max_tokens`` (``base_max_tokens``) as their limit, so only the
  chosen responses are long.

The chosen responses' tokens after their first would-be eos are the model's samples with eos
masked, and their logged log-probs are those of the masked distribution (as with vLLM's
``min_tokens``): the trainer trains on them like any other response. Each call appends one JSON line
to ``log``: the rows, the chosen ones, the median and target lengths, and its seconds until every
other response had ended (``bulk_seconds``) and in all (``seconds``); ``summarize`` reads them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

ENV = "EMPG_BENCH_LONG_TAIL"  # the settings, as JSON; only the runs the benchmark starts have it
MAX_TOKENS = 112  # the sampling cap with a tail: 128 positions of the demo model less its prompts (<= 7 tokens)
MAX_SEQ_LEN = 128  # train.max_seq_len with a tail: a prompt and a response of MAX_TOKENS


def environment(hook_dir: Path, log: Path, *, every: int, factor: float, base_max_tokens: int) -> dict[str, str]:
    """The environment that gives a run's hf engines the tail: ``hook_dir/sitecustomize.py`` and
    the settings; ``log`` gets one line per rollout call."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text("from benchmarks.long_tail import install\n\ninstall()\n")
    repo = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(hook_dir), str(repo), os.environ.get("PYTHONPATH")) if p)
    settings = {"every": every, "factor": factor, "base_max_tokens": base_max_tokens, "log": str(log)}
    return {"PYTHONPATH": path, ENV: json.dumps(settings)}


def install() -> None:
    """Wrap ``HfEngine._decode`` in a torchrun worker of a run given the settings (module docstring)."""
    if "RANK" not in os.environ or ENV not in os.environ:
        return
    from megatron_empg.rollout.hf_engine import HfEngine

    settings = json.loads(os.environ[ENV])
    decode = HfEngine._decode

    def long_tail_decode(self, model, rows, responses, sampling, *rest):
        if sampling.ignore_eos:  # the gate's probe: a continuation of fixed length, no tail
            return decode(self, model, rows, responses, sampling, *rest)
        if sampling.stop:
            raise ValueError("the long tail masks eos and stop token ids only; this sampling has stop strings")
        chosen = [_seed(r, i) % settings["every"] == settings["every"] - 1 for i, r in enumerate(responses)]
        for response, long in zip(responses, chosen):
            if not long:
                response.limit = min(response.limit, settings["base_max_tokens"])
        stop_ids = sorted(self._all_eos_ids | set(sampling.stop_token_ids))
        tail = _Tail(model, responses, chosen, stop_ids, settings["factor"])
        decode(self, tail if any(chosen) else model, rows, responses, sampling, *rest)
        seconds = time.perf_counter() - tail.start
        record = {
            "pid": os.getpid(),
            "rows": len(responses),
            "chosen": sum(chosen),
            "median_length": tail.median,
            "target_length": tail.target,
            "chosen_lengths": [len(r.token_ids) for r, c in zip(responses, chosen) if c],
            "bulk_seconds": tail.bulk_seconds if tail.bulk_seconds is not None else seconds,
            "seconds": seconds,
        }
        with open(settings["log"], "a") as f:  # one short line per call: appends of the engines do not mix
            f.write(json.dumps(record) + "\n")

    HfEngine._decode = long_tail_decode


def _seed(response, row: int) -> int:
    """The response's sampling seed (its generator's), else its row in the call (no seed set)."""
    return response.generator.initial_seed() if response.generator is not None else row


class _Tail:
    """The model as ``_decode`` calls it, with the chosen rows' stop ids masked in its logits until
    they may end; ``_decode``'s batch is always the unfinished responses in call order."""

    def __init__(self, model, responses, chosen: list[bool], stop_ids: list[int], factor: float) -> None:
        self.model, self.responses, self.chosen, self.factor = model, responses, chosen, factor
        self.stop_ids = stop_ids
        self.start = time.perf_counter()
        self.bulk_seconds: float | None = None
        self.median: float | None = None
        self.target: int | None = None

    def __getattr__(self, name):  # model.config, for the cache
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        import torch

        out = self.model(**kwargs)
        active = [i for i, r in enumerate(self.responses) if r.finish is None]
        others = [r for r, c in zip(self.responses, self.chosen) if not c]
        if self.target is None and all(r.finish is not None for r in others):
            self.bulk_seconds = time.perf_counter() - self.start
            lengths = [len(r.token_ids) for r in others]
            self.median = statistics.median(lengths) if lengths else 1.0
            self.target = math.ceil(self.factor * self.median)
            for r, c in zip(self.responses, self.chosen):
                if c:  # ends with "length" at the target; one already past it ends now
                    r.limit = min(r.limit, max(self.target, len(r.token_ids) + 1))
        masked = [
            b
            for b, i in enumerate(active)
            if self.chosen[i] and (self.target is None or len(self.responses[i].token_ids) < self.target)
        ]
        if masked and self.stop_ids:  # the token drawn next is the (len + 1)-th: no eos up to the target
            rows = torch.tensor(masked, device=out.logits.device)[:, None]
            out.logits[rows, -1, torch.tensor(self.stop_ids, device=out.logits.device)] = -torch.inf
        return out


def summarize(log: Path, first_step: int, timed_steps: range) -> dict | None:
    """The tail over the timed steps' rollouts (each engine process's n-th call, from 0, drew step
    ``first_step`` + n): per engine call, the means of the rows, the chosen ones and their length,
    the median and target lengths (calls with chosen rows), ``bulk_seconds``, ``seconds`` and
    ``tail_seconds`` = seconds - bulk_seconds (the stretch when only the chosen responses decode)."""
    if not log.is_file():
        return None
    calls: dict[int, list[dict]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        calls.setdefault(record["pid"], []).append(record)
    timed = [c for per_pid in calls.values() for n, c in enumerate(per_pid) if first_step + n in timed_steps]
    if not timed:
        return None

    def mean(values) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    out = {"engine_calls": len(timed), "engines": len(calls)}
    for key in ("rows", "chosen", "median_length", "target_length", "bulk_seconds", "seconds"):
        out[key] = mean(c[key] for c in timed)
    out["chosen_length_mean"] = mean(n for c in timed for n in c["chosen_lengths"])
    out["tail_seconds"] = mean(c["seconds"] - c["bulk_seconds"] for c in timed)
    return out
