"""Router replay (``algorithm.router_replay: rollout``) on the tiny Qwen3-MoE, float32, CPU.

The transformers engine samples; its routing goes, as the trainer carries it (Trajectory, Sample,
a packed micro-batch), into Megatron's forward of the same weights, whose routers are watched by a
hook on their ``routing_map``: every routed token's experts equal the engine's, and the log-probs
the engine's to float32 rounding. The vLLM path runs the real ``VllmEngine`` output conversion on
a recording stand-in for vLLM's ``LLM`` that returns ``CompletionOutput.routed_experts`` in vLLM's
layout (uint8 [prompt + response - 1, layers, k]). A mutation (one token's experts in one layer)
moves that token's routing and the log-probs of that position and the later ones of its sequence,
and nothing else. Full recompute replays the same experts in the backward pass (the gradients of a
replay that differs from the router's own choice equal those without recompute).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_empg.config import RolloutConfig, SamplingConfig, load_model_config
from megatron_empg.rollout.engine import EngineState
from megatron_empg.rollout.trajectory import Trajectory
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen3-moe"
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
SAMPLING = SamplingConfig(n=2, max_tokens=7, temperature=1.0, seed=11)
TOLERANCE = 2e-5  # float32 engine vs float32 Megatron (the conversion's logits agree to ~1e-6)
MUTATED = (0, 0, 4)  # (sample, layer, token position) whose experts the mutation changes: the first layer,
# so that the later tokens of its sequence see the change through the second layer's attention


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(load_model_config(MODEL), tmp_path_factory.mktemp(MODEL), seed=0))


def _samples(prompts, completions) -> list[Sample]:
    example = [SimpleNamespace(prompt_ids=p) for p in prompts]
    return [
        Sample.from_trajectory(example[i], i, Trajectory.from_completion(c))
        for i, group in enumerate(completions)
        for c in group
    ]


class RecordingLlm:
    """Stands in for vLLM's ``LLM`` in ``VllmEngine.generate``: records each request's prompt and
    params, samples it with a transformers engine and answers vLLM's ``CompletionOutput`` s, whose
    ``routed_experts`` is vLLM's [prompt + response - 1, layers, k] uint8 array."""

    llm_engine = SimpleNamespace(engine_core=None)  # no engine-core process to watch

    def __init__(self, engine, drop_prompt: bool = False) -> None:
        self.engine, self.drop_prompt, self.requests = engine, drop_prompt, []

    def generate(self, requests, params, use_tqdm):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput

        outputs = []
        for request, p in zip(requests, params):
            self.requests.append((request["prompt_token_ids"], p.n, p.seed, p.max_tokens))
            sampling = SamplingConfig(n=p.n, max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed)
            (group,) = self.engine.generate([request["prompt_token_ids"]], sampling)
            prompt = len(request["prompt_token_ids"])
            outputs.append(
                SimpleNamespace(
                    outputs=[
                        CompletionOutput(
                            index=j,
                            text="",
                            token_ids=c.token_ids,
                            cumulative_logprob=sum(c.logprobs),
                            logprobs=[{t: Logprob(lp)} for t, lp in zip(c.token_ids, c.logprobs)],
                            routed_experts=c.routed_experts[prompt if self.drop_prompt else 0 :]
                            .numpy()
                            .astype("uint8"),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        for j, c in enumerate(group)
                    ]
                )
            )
        return outputs


def _vllm_engine(llm):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)
    engine._state, engine._llm, engine._routed_experts, engine._skip_tokenizer_init = EngineState(), llm, True, False
    engine.vocab_size, engine.max_model_len, engine.weight_version = llm.engine.vocab_size, 256, None
    return engine


def _rank(rank: int, world_size: int, model_dir: str, batches: dict) -> dict:
    from megatron.core.transformer.moe.router import TopKRouter
    from safetensors.torch import load_file

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model, recompute_overrides
    from megatron_empg.mcore.moe import replay as router_replay
    from megatron_empg.mcore.step import StatsRequest, _model_forward, forward_stats
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.weight_sync import mapping

    model = load_model_config(MODEL)
    parallel = ParallelConfig(moe_token_dispatcher_type="allgather")
    groups = parallel_state.initialize_model_parallel(parallel, 5)
    full = mapping.to_megatron_state_dict(
        load_file(f"{model_dir}/model.safetensors"), model, parallel.padded_vocab_size(model.vocab_size)
    )
    seen: list[tuple[int, torch.Tensor]] = []  # (layer, routing_map [tokens, experts]) per router call

    def build(**overrides):
        (chunk,) = build_gpt_model(model, parallel, routing_replay=True, **overrides)
        load_full_state_dict([chunk], full)
        for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
            router.register_forward_hook(lambda m, i, out: seen.append((m.layer_number - 1, out[1].detach().clone())))
        return chunk

    def routed(calls):  # [layers][calls] [tokens, experts] bool: each layer's router's calls in order
        return [[m for layer, m in calls if layer == i] for i in range(model.num_layers)]

    chunk = build()
    out = {}
    for name, micro in batches.items():
        seen.clear()
        stats = forward_stats([chunk], micro, StatsRequest(vocab_size=model.vocab_size, with_entropy=False), groups)
        out[name] = {"logprobs": [s.logprobs for s in stats], "routing": routed(seen)}
    seen.clear()  # no routed_experts (the weight-sync gate's scoring): the router's own choice
    plain = [dataclasses.replace(mb, routed_experts=None) for mb in batches["mutated"]]
    forward_stats([chunk], plain, StatsRequest(vocab_size=model.vocab_size, with_entropy=False), groups)
    out["own"] = routed(seen)

    # Update pass with and without full recompute, the mutated routing replayed: F0 F1 B0 B1.
    grads = {}
    for mode in ("none", "full"):
        chunk = build(**recompute_overrides(mode, 1))
        chunk.train()
        seen.clear()
        losses = []
        for mb in batches["mutated"]:
            router_replay.set_micro_batch(chunk, mb)
            logits = _model_forward(chunk, mb).float()
            logprobs = logits.log_softmax(-1).gather(-1, mb.target_ids[..., None])[..., 0]
            losses.append(-(logprobs * mb.loss_mask).sum())
        for loss in losses:
            loss.backward()
        router_replay.clear([chunk])
        grads[mode] = {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}
        out[f"calls_{mode}"] = routed(seen)
    out["grad_diff"] = max((grads["none"][n] - grads["full"][n]).abs().max().item() for n in grads["none"])
    out["grad_count"] = len(grads["none"])
    return out


def _rank_split(rank: int, world_size: int, model_dir: str, micro: list) -> dict:
    """The replayed forward split two ways: PP 2 (each stage routes its own layer) and EP 2 (DP 2:
    each rank its own micro-batches; the experts split, the router whole)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from safetensors.torch import load_file

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.step import StatsRequest, forward_stats
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.weight_sync import mapping

    model = load_model_config(MODEL)
    request = StatsRequest(vocab_size=model.vocab_size, with_entropy=False)
    out = {}
    for name, parallel, mine in [
        ("pp", ParallelConfig(pipeline_model_parallel_size=2, moe_token_dispatcher_type="allgather"), micro),
        ("ep", ParallelConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"), micro[rank::2]),
    ]:
        groups = parallel_state.initialize_model_parallel(parallel, 5)
        (chunk,) = build_gpt_model(model, parallel, routing_replay=True)
        load_full_state_dict(
            [chunk],
            mapping.to_megatron_state_dict(
                load_file(f"{model_dir}/model.safetensors"), model, parallel.padded_vocab_size(model.vocab_size)
            ),
        )
        seen = []
        for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
            router.register_forward_hook(lambda m, i, o: seen.append((m.layer_number - 1, o[1].clone())))
        stats = forward_stats([chunk], mine, request, groups)
        out[name] = {"logprobs": None if stats is None else [s.logprobs for s in stats], "routing": seen}
        parallel_state.destroy_model_parallel()
    return out


def _expected_map(micro, num_experts: int) -> list[list[torch.Tensor]]:
    """[layers][micro-batches] [tokens, experts] bool of their ``routed_experts``, Megatron's token order."""
    from megatron_empg.mcore.moe.replay import token_routing

    maps = []
    for layer in range(micro[0].routed_experts.shape[2]):
        ids = [token_routing(mb)[:, layer] for mb in micro]
        maps.append([torch.zeros(len(i), num_experts, dtype=torch.bool).scatter_(1, i, True) for i in ids])
    return maps


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_replay_routes_as_the_engine_did_and_a_mutation_shows(model_dir):
    from megatron_empg.rollout.hf_engine import HfEngine

    model = load_model_config(MODEL)
    engine = HfEngine(model_dir, RolloutConfig(dtype="float32"), routed_experts=True)
    hf_samples = _samples(PROMPTS, engine.generate(PROMPTS, SAMPLING))
    llm = RecordingLlm(engine)
    vllm_samples = _samples(PROMPTS, _vllm_engine(llm).generate(PROMPTS, SAMPLING))
    assert [r[0] for r in llm.requests] == PROMPTS and {r[1:] for r in llm.requests} == {
        (2, 11, 7),
        (2, 13, 7),
        (2, 15, 7),
    }
    with pytest.raises(RuntimeError, match=r"routed experts of shape \[\d+, 2, 2\]; expected \[\d+, layers, top_k\]"):
        _vllm_engine(RecordingLlm(engine, drop_prompt=True)).generate(PROMPTS, SAMPLING)

    plan = MicroBatchPlan(packing=True, micro_batch_size=3, routing=(model.num_layers, model.moe_router_topk))
    advantages = [1.0] * len(hf_samples)
    hf_micro, vllm_micro = micro_batches(hf_samples, advantages, plan), micro_batches(vllm_samples, advantages, plan)
    sample, layer, position = MUTATED
    mutated_samples = [dataclasses.replace(s) for s in hf_samples]
    chosen = mutated_samples[sample].routed_experts.clone()
    old = chosen[position, layer].tolist()
    chosen[position, layer] = torch.tensor([e for e in range(model.num_experts) if e not in old][:2])
    mutated_samples[sample].routed_experts = chosen
    mutated_micro = micro_batches(mutated_samples, advantages, plan)
    padded = micro_batches(hf_samples, advantages, dataclasses.replace(plan, packing=False))  # [3, s] rows
    out = run_distributed(
        _rank,
        1,
        model_dir,
        {"hf": hf_micro, "vllm": vllm_micro, "mutated": mutated_micro, "padded": padded},
        timeout=240,
    )[0]
    split = run_distributed(_rank_split, 2, model_dir, mutated_micro, timeout=240)

    for name, micro, samples in (("hf", hf_micro, hf_samples), ("vllm", vllm_micro, vllm_samples)):
        expected = _expected_map(micro, model.num_experts)
        for i in range(model.num_layers):  # every token, padding included, dispatched as the engine routed it
            assert _equal(out[name]["routing"][i], expected[i]), (name, i)
        assert sum(int(mb.loss_mask.sum()) for mb in micro) == sum(len(s.response_ids) for s in samples)
        ours = torch.cat([lp[mb.loss_mask] for lp, mb in zip(out[name]["logprobs"], micro)])
        sampled = torch.cat([mb.sampler_logprobs[mb.loss_mask] for mb in micro])  # the engine's, packed order
        assert (ours - sampled).abs().max() < TOLERANCE, name
    assert _equal(out["hf"]["routing"][0], out["vllm"]["routing"][0])  # same seeds: the same samples
    # Padded rows: Megatron routes token (row b, position t) as its t * rows + b-th; the log-probs are the engine's.
    for i in range(model.num_layers):
        for mb, seen in zip(padded, out["padded"]["routing"][i], strict=True):
            rows, width = mb.shape
            ids = torch.stack([mb.routed_experts[b, t, i] for t in range(width) for b in range(rows)]).long()
            assert torch.equal(seen, torch.zeros_like(seen).scatter_(1, ids, True))
    ours = torch.cat([lp[mb.loss_mask] for lp, mb in zip(out["padded"]["logprobs"], padded)])
    assert (ours - torch.cat([mb.sampler_logprobs[mb.loss_mask] for mb in padded])).abs().max() < TOLERANCE

    # The mutation: one token of one layer; the log-probs from that position on in its sequence.
    changed = [
        sum(int((a != b).any(-1).sum()) for a, b in zip(m, h))
        for m, h in zip(out["mutated"]["routing"], out["hf"]["routing"])
    ]
    assert changed == [1 if i == layer else 0 for i in range(model.num_layers)]
    for i, (mb, mutated) in enumerate(zip(hf_micro, mutated_micro)):
        diff = (out["mutated"]["logprobs"][i] - out["hf"]["logprobs"][i]).abs()[0]
        moved = (mb.routed_experts != mutated.routed_experts).any(-1).any(-1)[0].nonzero().flatten().tolist()
        if not moved:
            assert diff.max() == 0, i
            continue
        (column,) = moved
        segment = int(mb.seq_ids[0, column])
        later = (torch.arange(diff.numel()) >= column) & (mb.seq_ids[0] == segment)
        assert diff[~later].max() == 0 and diff[column] > 1e-4 and diff[later].min() > 0, (i, column)

    # Without routed_experts the router chooses: not the mutated expert, whatever else it agrees on.
    assert not _equal(out["own"][layer], out["mutated"]["routing"][layer])
    # Full recompute replays the same (mutated) experts in the backward pass: the same gradients.
    assert out["grad_count"] > 0 and out["grad_diff"] < 1e-6, out["grad_diff"]
    expected, n = _expected_map(mutated_micro, model.num_experts), len(mutated_micro)
    # PP 2: stage r's router is layer r's and replays that layer's experts; the last stage's log-probs
    # are the whole model's. EP 2: each rank's micro-batches as in the whole model.
    for r in range(2):
        assert {i for i, _ in split[r]["pp"]["routing"]} == {r}
        assert _equal([m for _, m in split[r]["pp"]["routing"]], expected[r])
        assert _equal([m for i, m in split[r]["ep"]["routing"] if i == 0], expected[0][r::2])
        for ours, whole in zip(split[r]["ep"]["logprobs"], out["mutated"]["logprobs"][r::2], strict=True):
            assert (ours - whole).abs().max() < 1e-5
    assert split[0]["pp"]["logprobs"] is None
    for ours, whole in zip(split[1]["pp"]["logprobs"], out["mutated"]["logprobs"], strict=True):
        assert (ours - whole).abs().max() < 1e-5
    for i in range(model.num_layers):
        calls = out["calls_full"][i]
        assert len(calls) == 2 * n  # the forwards, then the recomputes in the same order
        assert (
            _equal(calls[:n], expected[i])
            and _equal(calls[n:], expected[i])
            and _equal(out["calls_none"][i], expected[i])
        )
