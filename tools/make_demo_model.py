"""Write the warm-start model of the CPU demo: a small Qwen2 model supervised-trained on the
synthetic arithmetic task so that it knows most answers but often answers in a form the reward
rejects or samples a neighbour of the answer, both of which RL from verifiable rewards can fix.

    python tools/make_demo_model.py OUT_DIR [--steps N] [--stop-accuracy A] [--answer-noise P]
        [--restate-fraction R] [--seed S] [--digits D] [--ops + -] [--batch-size B] [--lr LR]
        [--verify-vllm] [model overrides ...]

A randomly initialised model never samples a correct answer, so RL from it has no signal. This
tool builds the model with ``tools/make_tiny_model.py`` (random weights, character tokenizer;
``model_configs/demo-qwen2.yaml``: 2 layers, hidden 128, 4 heads of 32, 2 KV groups, ffn 512,
vocabulary 128, 525k parameters), trains it with plain torch (AdamW, warmup + cosine over
``--steps``, CPU) on ``tasks.arithmetic.ArithmeticTask`` prompts followed by the answer, "\n" and
eos, with the loss on those answer tokens only, and measures it with the demo's reward
(``tasks.arithmetic.arithmetic_reward``) on ``EVAL_PROBLEMS`` held-out problems (their own
stream, ``EVAL_DATA_SEED``): greedy accuracy, and the accuracy of ``EVAL_SAMPLES`` samples per
problem at temperature 1, each response at most ``EVAL_MAX_TOKENS`` tokens.

``--answer-noise`` (default 0.3) puts that fraction of the training answers off by one, so the
model learns the answer as its mode with its neighbours next to it. ``--restate-fraction``
(default 0.4) makes that fraction of the training responses restate the problem first
("12+34=46"), a habit the reward scores 0 (the first line must be the integer alone), as an SFT
model's format habits are in real RL runs. Why both: RL from a warm start that only lacks
arithmetic precision climbs slowly at this size (+0.02 to +0.035 sampled accuracy in 600 steps,
three seeds; a noise-free warm start, greedy 25%, did not improve at any learning rate from 3e-5
to 1e-3), because new arithmetic knowledge needs many updates of a 525k-parameter model; a
habit shared by all prompts is a direction every sample's gradient agrees on.

How far it trains: the accuracy of a given number of steps varies a lot with the seed (noise-free,
1500 steps: 22-98 % greedy over seeds 0-4), and so would vary with the CPU's float rounding. So
every ``CHECK_EVERY`` steps the greedy accuracy on ``VALIDATION_PROBLEMS`` other held-out
problems is measured, and training stops once it reaches ``--stop-accuracy`` (default 0.7; 0
trains all ``--steps``). With the defaults (2-digit "+"/"-" problems, the demo's difficulty) seed
0 stopped after 3700 steps at 69.9 % greedy and 35.7 % sampled accuracy, 36.2 % of the samples
restating the problem.
Training skips the evaluation and validation problems' texts. ``demo_model.json`` records what
was measured.

OUT_DIR receives, from ``save_pretrained``: ``config.json``, ``generation_config.json``,
``model.safetensors`` (float32) and the tokenizer files; also ``model_config.yaml`` (the
``ModelConfig``) and ``demo_model.json`` (settings, losses, accuracies, seconds). It is written
in a temp directory next to it and renamed at the end; it must not exist or be empty (else exit
code 2). On one machine the same arguments (seed, ``--threads``) give the same files; another
CPU may round differently and train to another stopping step.

``--verify-vllm`` also loads the model into a ``VllmEngine`` (float32, eager, in-process) before
the rename and records vLLM's greedy and sampled accuracies on the same problems, and how many
problems' greedy correctness differs from the HF measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_empg.config import DataConfig, ModelConfig, load_model_config, to_yaml  # noqa: E402
from megatron_empg.tasks.arithmetic import ArithmeticTask, arithmetic_reward  # noqa: E402
from tools.make_tiny_model import NUM_BASE_TOKENS, char_tokenizer, tiny_hf_model  # noqa: E402

DEMO_MODEL = "demo-qwen2"  # model_configs/demo-qwen2.yaml, the model recipes/demo_cpu.yaml trains
VLLM_CPU_HEAD_DIMS = (32, 64)  # the head sizes this tool allows (vLLM CPU attention supports them)

DEFAULT_STEPS = 4000  # at most; training stops earlier at DEFAULT_STOP_ACCURACY
DEFAULT_STOP_ACCURACY = 0.7  # validation greedy accuracy that ends training (0: train all steps)
DEFAULT_ANSWER_NOISE = 0.3  # fraction of training answers off by one
DEFAULT_RESTATE_FRACTION = 0.4  # fraction of training responses that restate the problem first
CHECK_EVERY = 50  # steps between validation checks
DEFAULT_SEED = 0
DEFAULT_DIGITS = 2
DEFAULT_OPS = ["+", "-"]
DEFAULT_BATCH_SIZE = 64
DEFAULT_LR = 2e-3
WARMUP_STEPS = 50
MIN_LR_RATIO = 0.1  # the cosine decays to this fraction of the peak learning rate
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
INIT_STD = 0.02  # of tiny_hf_model's random weights (norm weights around 1)

EVAL_DATA_SEED = 999_999  # the held-out problems' stream (training streams use --seed)
EVAL_PROBLEMS = 256
VALIDATION_DATA_SEED = 1_000_000  # the stopping rule's problems (also held out)
VALIDATION_PROBLEMS = 256
EVAL_SAMPLES = 4  # samples per problem at temperature 1
EVAL_MAX_TOKENS = 16  # response length limit (an answer, "\n" and eos take at most 2 * digits + 2)
EVAL_SAMPLING_SEED = 1234
LOG_EVERY = 100


class UsageError(ValueError):
    """A bad argument (the CLI exits with code 2)."""


# --------------------------------------------------------------------------------------------
# The model and the data.


def demo_model_config(overrides: Sequence[str] = ()) -> ModelConfig:
    """``DEMO_MODEL`` with dotted overrides; the head dimension must be one vLLM's CPU attention runs."""
    model = load_model_config(DEMO_MODEL, overrides)
    if model.kv_channels not in VLLM_CPU_HEAD_DIMS:
        raise UsageError(
            f"head dimension {model.kv_channels} (hidden_size={model.hidden_size} / num_attention_heads="
            f"{model.num_attention_heads}): expected one of {VLLM_CPU_HEAD_DIMS} (vLLM's CPU attention)"
        )
    if model.vocab_size < NUM_BASE_TOKENS:
        raise UsageError(f"vocab_size={model.vocab_size} is below the character tokenizer's {NUM_BASE_TOKENS} tokens")
    return model


def data_config(seed: int, digits: int, ops: Sequence[str]) -> DataConfig:
    return DataConfig(
        source="arithmetic", reward="arithmetic", seed=seed, arithmetic_digits=digits, arithmetic_ops=list(ops)
    )


class TrainingStream:
    """The training sequences: problems ``0, 1, 2, ...`` of an ``ArithmeticTask`` whose text is not
    in ``excluded``, each as (prompt ids exactly as ``task.example`` gives them, answer ids).

    ``answer_noise``: the fraction of problems whose training answer is off by one (+1 or -1, +1
    where -1 would be negative); ``restate_fraction``: the fraction of responses that restate the
    problem before the answer ("12+34=46" instead of "46"), which the demo's reward rejects (its
    first line must be the integer alone). Both are drawn per problem index from ``noise_seed``."""

    def __init__(
        self,
        task: ArithmeticTask,
        tokenizer: Any,
        excluded: set[str],
        *,
        answer_noise: float = 0.0,
        restate_fraction: float = 0.0,
        noise_seed: int = 0,
    ) -> None:
        self.task, self.tokenizer, self.excluded = task, tokenizer, excluded
        self.answer_noise, self.restate_fraction, self.noise_seed = answer_noise, restate_fraction, noise_seed
        self.eos = tokenizer.eos_token_id
        self.next_index = 0
        self._prompts: dict[str, list[int]] = {}
        self._answers: dict[str, list[int]] = {}  # response text -> its ids and eos
        self.checked = False

    def training_answer(self, index: int, answer: int) -> int:
        """Problem ``index``'s answer as trained on: ``answer``, or off by one for ``answer_noise`` of them."""
        if self.answer_noise == 0:
            return answer
        rng = random.Random(f"answer-noise:{self.noise_seed}:{index}")
        if rng.random() >= self.answer_noise:
            return answer
        shifted = answer + rng.choice((-1, 1))
        return shifted if shifted >= 0 else answer + 1

    def restates(self, index: int) -> bool:
        """Whether problem ``index``'s training response restates the problem before its answer."""
        if self.restate_fraction == 0:
            return False
        return random.Random(f"restate:{self.noise_seed}:{index}").random() < self.restate_fraction

    def batch(self, size: int) -> list[tuple[list[int], list[int]]]:
        problems = []
        while len(problems) < size:
            problem = self.task.problem(self.next_index)
            if problem.text not in self.excluded:
                problems.append((self.next_index, problem, self.training_answer(self.next_index, problem.answer)))
            self.next_index += 1
        new = sorted({p.text for _, p, _ in problems} - self._prompts.keys())
        if new:  # the task's own rendering and tokenization, in one call per batch
            formatter = self.task.formatter
            self._prompts.update(zip(new, formatter.encode([formatter.render(text) for text in new])))
        responses = [f"{p.text if self.restates(i) else ''}{value}\n" for i, p, value in problems]
        new = sorted(set(responses) - self._answers.keys())
        if new:
            encoded = self.tokenizer(new, add_special_tokens=False)["input_ids"]
            self._answers.update((text, [*ids, self.eos]) for text, ids in zip(new, encoded))
        if not self.checked:  # the cache holds what the RL demo's prompts will be
            index, problem, _ = problems[0]
            if self.task.example(index).prompt_ids != self._prompts[problem.text]:
                raise RuntimeError("training prompt ids differ from ArithmeticTask.example's")
            self.checked = True
        return [(self._prompts[p.text], self._answers[text]) for (_, p, _), text in zip(problems, responses)]


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids ``[B, T]`` and next-token labels ``[B, T]`` (-100 outside the answers)."""
    length = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(batch):
        sequence = prompt + answer
        ids[row, : len(sequence)] = torch.tensor(sequence)
        # position t predicts token t + 1: the answer tokens are predicted from len(prompt) - 1 on
        labels[row, len(prompt) - 1 : len(sequence) - 1] = torch.tensor(answer)
    return ids, labels


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warmup over ``WARMUP_STEPS``, then cosine down to ``MIN_LR_RATIO * peak`` at the last step."""
    warmup = min(WARMUP_STEPS, max(1, steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(
    model: torch.nn.Module,
    stream: TrainingStream,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    validate: Callable[[], float] | None = None,
    stop_accuracy: float = 0.0,
    check_every: int = CHECK_EVERY,
    log: Callable[[str], None] = print,
) -> tuple[list[float], list[tuple[int, float]]]:
    """At most ``steps`` AdamW steps on the answer tokens' mean cross-entropy (the learning rate
    schedule spans ``steps``). Every ``check_every`` steps ``validate()`` (with the model in eval
    mode) gives an accuracy; training stops at the first one >= ``stop_accuracy`` (0: never).
    Returns each step's loss and the ``(step, accuracy)`` checks."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=WEIGHT_DECAY)
    model.train()
    losses: list[float] = []
    checks: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        ids, labels = collate(stream.batch(batch_size), stream.eos)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            recent = losses[-LOG_EVERY:]
            log(f"step {step + 1}/{steps}: loss {sum(recent) / len(recent):.4f} ({time.perf_counter() - start:.1f} s)")
        if validate is not None and (step + 1) % check_every == 0:
            model.eval()
            checks.append((step + 1, validate()))
            model.train()
            if stop_accuracy > 0 and checks[-1][1] >= stop_accuracy:
                log(f"step {step + 1}: validation greedy accuracy {checks[-1][1]:.3f} >= {stop_accuracy}: stop")
                break
    model.eval()
    return losses, checks


# --------------------------------------------------------------------------------------------
# Measuring: HF and vLLM generation scored by the demo's reward.


@torch.no_grad()
def hf_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    eos_id: int,
    max_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Each prompt's response ids (up to and including the first eos, at most ``max_tokens``):
    greedy at temperature 0, else sampled from softmax(logits / temperature). Prompts of one
    length run as one batch (no padding)."""
    responses: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_length[len(prompt)].append(i)
    for length in sorted(by_length):
        rows = by_length[length]
        ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long)
        done = torch.zeros(len(rows), dtype=torch.bool)
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            for row, (i, finished) in enumerate(zip(rows, done.tolist())):
                if not finished:
                    responses[i].append(int(token[row]))
            done |= token == eos_id
            if bool(done.all()):
                break
            ids = torch.cat([ids, token[:, None]], dim=1)
    return responses


def score(tokenizer: Any, responses: Sequence[Sequence[int]], examples: Sequence[Any]) -> list[bool]:
    """Whether each response answers its example, by the demo's reward (text without special tokens)."""
    texts = tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
    return arithmetic_reward(texts, list(examples)).correct


def restated(tokenizer: Any, responses: Sequence[Sequence[int]], examples: Sequence[Any]) -> list[bool]:
    """Whether each response restates its problem ("12+34=...") instead of answering with the number alone."""
    texts = tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
    return [text.startswith(example.meta["problem"]) for text, example in zip(texts, examples)]


def evaluation_examples(
    digits: int, ops: Sequence[str], tokenizer: Any, count: int = EVAL_PROBLEMS, data_seed: int = EVAL_DATA_SEED
) -> list[Any]:
    """Problems ``0 .. count - 1`` of a held-out stream (``EVAL_DATA_SEED``) as ``PromptExample`` s."""
    task = ArithmeticTask(data_config(data_seed, digits, ops), tokenizer)
    return [task.example(i) for i in range(count)]


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, examples: Sequence[Any]) -> float:
    responses = hf_generate(
        model,
        [e.prompt_ids for e in examples],
        eos_id=tokenizer.eos_token_id,
        max_tokens=EVAL_MAX_TOKENS,
        temperature=0.0,
    )
    correct = score(tokenizer, responses, examples)
    return sum(correct) / len(correct)


def evaluate_hf(model: torch.nn.Module, tokenizer: Any, examples: Sequence[Any]) -> dict[str, Any]:
    prompts = [e.prompt_ids for e in examples]
    eos = tokenizer.eos_token_id
    greedy = score(
        tokenizer, hf_generate(model, prompts, eos_id=eos, max_tokens=EVAL_MAX_TOKENS, temperature=0.0), examples
    )
    generator = torch.Generator().manual_seed(EVAL_SAMPLING_SEED)
    repeated = [e for e in examples for _ in range(EVAL_SAMPLES)]
    samples = hf_generate(
        model,
        [e.prompt_ids for e in repeated],
        eos_id=eos,
        max_tokens=EVAL_MAX_TOKENS,
        temperature=1.0,
        generator=generator,
    )
    return accuracies(tokenizer, greedy, samples, repeated)


def accuracies(tokenizer: Any, greedy: list[bool], samples: list[list[int]], repeated: list[Any]) -> dict[str, Any]:
    """The measurements of a model: greedy correctness ``greedy`` (one per problem) and the
    ``samples`` of the problems ``repeated`` ``EVAL_SAMPLES`` times each."""
    sampled = score(tokenizer, samples, repeated)
    restating = restated(tokenizer, samples, repeated)
    return {
        "greedy_accuracy": sum(greedy) / len(greedy),
        "sampled_accuracy": sum(sampled) / len(sampled),
        "sampled_restated": sum(restating) / len(restating),
        "greedy_correct": greedy,
    }


def evaluate_vllm(model_dir: str | Path, tokenizer: Any, examples: Sequence[Any]) -> dict[str, Any]:
    """vLLM's greedy and sampled accuracies of the model in ``model_dir`` (an in-process ``VllmEngine``)."""
    from megatron_empg.config import RolloutConfig, SamplingConfig
    from megatron_empg.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(
        model_dir, RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=128, in_process=True)
    )
    try:
        prompts = [e.prompt_ids for e in examples]
        greedy_out = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=EVAL_MAX_TOKENS))
        sampled_out = engine.generate(
            prompts,
            SamplingConfig(n=EVAL_SAMPLES, temperature=1.0, max_tokens=EVAL_MAX_TOKENS, seed=EVAL_SAMPLING_SEED),
        )
    finally:
        engine.shutdown()
    greedy = score(tokenizer, [c[0].token_ids for c in greedy_out], examples)
    samples = [list(c.token_ids) for cs in sampled_out for c in cs]
    return accuracies(tokenizer, greedy, samples, [e for e in examples for _ in range(EVAL_SAMPLES)])


# --------------------------------------------------------------------------------------------
# The output directory.


def output_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot receive the model (it exists and is not an empty directory), or None."""
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            return f"OUT_DIR {out} exists and is not a directory"
        if next(out.iterdir(), None) is not None:
            return f"OUT_DIR {out} exists and is not empty"
    return None


def check_arguments(
    out: Path,
    *,
    steps: int,
    seed: int,
    digits: int,
    ops: Sequence[str],
    model_overrides: Sequence[str],
    batch_size: int,
    lr: float,
    stop_accuracy: float,
    eval_problems: int,
    answer_noise: float = 0.0,
    restate_fraction: float = 0.0,
) -> tuple[DataConfig, ModelConfig]:
    """The training data's and the model's configs; ``UsageError`` / ``ConfigError`` name a bad argument."""
    problem = output_dir_problem(out)
    if problem is not None:
        raise UsageError(f"refusing to write the model: {problem}")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("eval_problems", eval_problems)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an int >= 1, got {value!r}")
    if not lr > 0:
        raise UsageError(f"lr must be > 0, got {lr!r}")
    if not 0 <= stop_accuracy <= 1:
        raise UsageError(f"stop_accuracy must be in [0, 1] (0: train all steps), got {stop_accuracy!r}")
    if not 0 <= answer_noise < 1:
        raise UsageError(f"answer_noise must be in [0, 1), got {answer_noise!r}")
    if not 0 <= restate_fraction < 1:
        raise UsageError(f"restate_fraction must be in [0, 1), got {restate_fraction!r}")
    data = data_config(seed, digits, ops)  # DataConfig checks seed, digits and ops
    return data, demo_model_config(model_overrides)


def make_demo_model(
    out_dir: str | os.PathLike,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = DEFAULT_SEED,
    digits: int = DEFAULT_DIGITS,
    ops: Sequence[str] = tuple(DEFAULT_OPS),
    model_overrides: Sequence[str] = (),
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    stop_accuracy: float = DEFAULT_STOP_ACCURACY,
    eval_problems: int = EVAL_PROBLEMS,
    answer_noise: float = DEFAULT_ANSWER_NOISE,
    restate_fraction: float = DEFAULT_RESTATE_FRACTION,
    verify_vllm: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build, train, measure and write the demo model to ``out_dir``; returns ``demo_model.json``'s content.

    Uses the process's torch thread count as it is (the CLI sets ``--threads``).
    """
    out = Path(out_dir)
    data, model_config = check_arguments(
        out,
        steps=steps,
        seed=seed,
        digits=digits,
        ops=ops,
        model_overrides=model_overrides,
        batch_size=batch_size,
        lr=lr,
        stop_accuracy=stop_accuracy,
        eval_problems=eval_problems,
        answer_noise=answer_noise,
        restate_fraction=restate_fraction,
    )
    start = time.perf_counter()

    torch.manual_seed(seed)
    tokenizer = char_tokenizer(model_config.vocab_size)
    model = tiny_hf_model(model_config, seed=seed, std=INIT_STD)
    examples = evaluation_examples(digits, ops, tokenizer, eval_problems)
    validation = evaluation_examples(digits, ops, tokenizer, VALIDATION_PROBLEMS, VALIDATION_DATA_SEED)
    # Held out: training skips the evaluation and validation problems' texts, unless that would
    # leave too few problems to train on (1-digit problems: a few hundred in all).
    space = 10 ** (2 * digits) * len(ops)
    held_out = space >= 20 * (eval_problems + VALIDATION_PROBLEMS)
    excluded = {e.meta["problem"] for e in [*examples, *validation]} if held_out else set()
    stream = TrainingStream(
        ArithmeticTask(data, tokenizer),
        tokenizer,
        excluded,
        answer_noise=answer_noise,
        restate_fraction=restate_fraction,
        noise_seed=seed,
    )
    log(
        f"training {model_config.name} ({model_config.num_parameters():,} parameters) for at most {steps} steps "
        f"of {batch_size} {digits}-digit {''.join(ops)} problems on {torch.get_num_threads()} threads, until "
        f"the validation greedy accuracy reaches {stop_accuracy}"
    )
    losses, checks = train(
        model,
        stream,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        stop_accuracy=stop_accuracy,
        validate=(lambda: greedy_accuracy(model, tokenizer, validation)) if stop_accuracy > 0 else None,
        log=log,
    )
    train_s = time.perf_counter() - start

    hf = evaluate_hf(model, tokenizer, examples)
    eval_s = time.perf_counter() - start - train_s
    log(
        f"HF: greedy accuracy {hf['greedy_accuracy']:.3f}, sampled (T=1) {hf['sampled_accuracy']:.3f}, "
        f"samples restating the problem {hf['sampled_restated']:.3f} ({eval_s:.1f} s)"
    )
    window = max(1, min(50, len(losses) // 4))
    summary: dict[str, Any] = {
        "model": model_config.name,
        "family": model_config.family,
        "num_parameters": model_config.num_parameters(),
        "settings": {
            "steps": steps,
            "stop_accuracy": stop_accuracy,
            "check_every": CHECK_EVERY,
            "seed": seed,
            "digits": digits,
            "ops": list(ops),
            "answer_noise": answer_noise,
            "restate_fraction": restate_fraction,
            "batch_size": batch_size,
            "lr": lr,
            "warmup_steps": min(WARMUP_STEPS, max(1, steps // 10)),
            "min_lr_ratio": MIN_LR_RATIO,
            "weight_decay": WEIGHT_DECAY,
            "grad_clip": GRAD_CLIP,
            "init_std": INIT_STD,
            "model_overrides": list(model_overrides),
            "torch_threads": torch.get_num_threads(),
        },
        "training": {
            "steps_run": len(losses),
            "stopped_early": len(losses) < steps,
            "problems_seen": len(losses) * batch_size,
            "loss_first": sum(losses[:window]) / window,  # mean of the first `window` steps
            "loss_last": sum(losses[-window:]) / window,
            "loss_window": window,
            "losses_every_10": [round(x, 5) for x in losses[::10]],
            "validation": {
                "data_seed": VALIDATION_DATA_SEED,
                "problems": VALIDATION_PROBLEMS,
                "greedy_accuracy_at_step": [[step, accuracy] for step, accuracy in checks],
            },
            "seconds": round(train_s, 2),
        },
        "evaluation": {
            "data_seed": EVAL_DATA_SEED,
            "problems": eval_problems,
            "held_out": held_out,
            "samples_per_problem": EVAL_SAMPLES,
            "max_tokens": EVAL_MAX_TOKENS,
            "reward": "arithmetic",
            "hf": {key: hf[key] for key in ("greedy_accuracy", "sampled_accuracy", "sampled_restated")},
            "seconds": round(eval_s, 2),
        },
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "model_config.yaml").write_text(to_yaml(model_config))
        if verify_vllm:
            vllm_start = time.perf_counter()
            vllm = evaluate_vllm(tmp, tokenizer, examples)
            differ = sum(a != b for a, b in zip(vllm["greedy_correct"], hf["greedy_correct"]))
            summary["evaluation"]["vllm"] = {
                **{key: vllm[key] for key in ("greedy_accuracy", "sampled_accuracy", "sampled_restated")},
                "greedy_differs_from_hf": differ,
                "seconds": round(time.perf_counter() - vllm_start, 2),
            }
            log(
                f"vLLM: greedy accuracy {vllm['greedy_accuracy']:.3f}, sampled (T=1) "
                f"{vllm['sampled_accuracy']:.3f}; greedy correctness differs from HF on {differ} problems"
            )
        summary["seconds"] = round(time.perf_counter() - start, 2)
        (tmp / "demo_model.json").write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, out)  # atomic; replaces an empty directory, fails on a non-empty one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the model directory to write (must not exist or be empty)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="at most this many training steps")
    parser.add_argument(
        "--stop-accuracy",
        type=float,
        default=DEFAULT_STOP_ACCURACY,
        help="stop once the validation greedy accuracy reaches this (0: train all steps)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights and training data")
    parser.add_argument("--digits", type=int, default=DEFAULT_DIGITS, help="operands have up to this many digits")
    parser.add_argument("--ops", nargs="+", default=DEFAULT_OPS, help="operators, e.g. --ops + - or --ops '+-*'")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak learning rate")
    parser.add_argument(
        "--answer-noise",
        type=float,
        default=DEFAULT_ANSWER_NOISE,
        help=f"fraction of training answers off by one (default {DEFAULT_ANSWER_NOISE})",
    )
    parser.add_argument(
        "--restate-fraction",
        type=float,
        default=DEFAULT_RESTATE_FRACTION,
        help="fraction of training responses that restate the problem before the answer "
        f"(default {DEFAULT_RESTATE_FRACTION})",
    )
    parser.add_argument("--eval-problems", type=int, default=EVAL_PROBLEMS, help="held-out problems measured")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--verify-vllm", action="store_true", help="also measure the model in a VllmEngine")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the model config, e.g. num_layers=4")
    args = parser.parse_args(argv)
    ops = [char for op in args.ops for char in op]
    try:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        check_arguments(
            Path(args.out_dir),
            steps=args.steps,
            seed=args.seed,
            digits=args.digits,
            ops=ops,
            model_overrides=args.overrides,
            batch_size=args.batch_size,
            lr=args.lr,
            stop_accuracy=args.stop_accuracy,
            eval_problems=args.eval_problems,
            answer_noise=args.answer_noise,
            restate_fraction=args.restate_fraction,
        )
    except ValueError as error:  # UsageError, ConfigError
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    summary = make_demo_model(
        args.out_dir,
        steps=args.steps,
        seed=args.seed,
        digits=args.digits,
        ops=ops,
        model_overrides=args.overrides,
        batch_size=args.batch_size,
        lr=args.lr,
        stop_accuracy=args.stop_accuracy,
        eval_problems=args.eval_problems,
        answer_noise=args.answer_noise,
        restate_fraction=args.restate_fraction,
        verify_vllm=args.verify_vllm,
    )
    print(f"wrote {args.out_dir} in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
