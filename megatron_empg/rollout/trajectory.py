"""What a rollout hands the trainer: one ``Trajectory`` per sample.

A trajectory is the response to one prompt, from a single ``generate`` call (a ``Completion``) or
from a multi-turn episode (``search_agent.Episode``), whose observation tokens carry no sampler
log-prob and are masked out of the loss. Plain Python values (and the routing, a CPU tensor), so
trajectories cross process groups as pickled objects.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_empg.rollout.engine import FINISH_REASONS, Completion, check_routed_experts


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One sampled response.

    ``token_ids``: ``[T]`` ints after the prompt. ``logprobs``: ``[T]`` floats, the sampler's
    log-prob of each generated token (0.0 on observation tokens). ``finish_reason``: one of
    ``engine.FINISH_REASONS``. ``response_mask``: ``[T]`` bools, True where the policy generated
    the token; None: all generated. ``stats``: per-sample counts summed into the step's metrics
    (an episode's turns, searches, ...). ``versions``: ``[T]``, the engine's ``weight_version``
    that sampled each token (``Completion.versions``); None: one version for all.
    ``routed_experts``: ``[P + T - 1, layers, top_k]`` int16, the engine's routing of prompt and
    response (``Completion.routed_experts``); None: not returned.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    response_mask: list[bool] | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    versions: list[str | None] | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Trajectory: {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")
        if self.response_mask is not None and len(self.response_mask) != len(self.token_ids):
            raise ValueError(f"Trajectory: {len(self.token_ids)} token ids but {len(self.response_mask)} mask entries")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"Trajectory: {len(self.token_ids)} token ids but {len(self.versions)} versions")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Trajectory.finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}")
        check_routed_experts(self.routed_experts, len(self.token_ids), "Trajectory")

    @classmethod
    def from_completion(cls, completion: Completion) -> Trajectory:
        versions = None if completion.versions is None else list(completion.versions)
        return cls(
            list(completion.token_ids),
            list(completion.logprobs),
            completion.finish_reason,
            versions=versions,
            routed_experts=completion.routed_experts,
        )
