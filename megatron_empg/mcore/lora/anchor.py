"""The EMA anchor of a LoRA policy: the policy's own (frozen) base with an EMA of its adapters.

EMA-PG's anchor is ``tau * anchor + (1 - tau) * policy`` over the trained parameters. With a frozen
base those are the adapters, so the anchor is the base plus averaged adapters: it costs the
adapters' bytes (a float32 master and a copy in the adapters' dtype), not a second model. After
the optimizer step of every step ``t`` with ``schedule.should_update(t)``::

    master  <- tau * master + (1 - tau) * main        (float32; ``main``: the optimizer's float32
                                                       main parameter of each adapter)
    values  <- cast(master)                            (the adapters' dtype)

The anchor pass runs the policy's chunks with the anchor's adapter values swapped in
(``forward_models``) and the policy's back after it: no second base anywhere. ``tau = 1`` keeps
the initial adapters (B = 0 at initialization: the base itself, GRPO's fixed reference).

Checkpoints: the same interface as ``mcore.anchor.EmaAnchor`` (``full_master_state`` keyed
``"<chunk>.<parameter name>"``, ``load_full_master_state``, ``models`` for the sharded metadata,
``averages(name)``: which parameters the master holds).

The distributed optimizer is not supported with LoRA (the bind step refuses it: the adapters'
optimizer state is small); every rank holds its adapters' whole master.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from megatron_empg.core.ema import EmaSchedule, ScheduledEma, ema_update_
from megatron_empg.mcore.anchor.layout import main_params
from megatron_empg.mcore.lora.model import is_adapter


class AdapterAnchor(ScheduledEma):
    """EMA anchor over a LoRA policy's adapters (module docstring).

    Args:
        policy_models: the policy's chunks wrapped in Megatron DDP.
        optimizer: the policy's Megatron optimizer (not the distributed one).
        tau, period, first_update: the ``core.ema.EmaSchedule``.
    """

    def __init__(
        self, policy_models: Sequence[torch.nn.Module], optimizer, *, tau: float, period: int, first_update=None
    ) -> None:
        super().__init__(EmaSchedule(tau=tau, period=period, first_update=first_update))
        self.policy_models = list(policy_models)
        self.models = [getattr(m, "module", m) for m in self.policy_models]
        mains, sharded = main_params(optimizer)
        if sharded:
            raise NotImplementedError(
                "a LoRA anchor with the distributed optimizer (optimizer.use_distributed_optimizer)"
            )
        self._params: dict[str, torch.nn.Parameter] = {}
        self._mains: dict[str, Tensor] = {}
        for c, chunk in enumerate(self.models):
            for name, param in chunk.named_parameters():
                if not is_adapter(name):
                    continue
                if param not in mains:
                    raise ValueError(f"chunk {c} {name}: the optimizer has no main parameter for this adapter")
                key = f"{c}.{name}"
                self._params[key] = param
                self._mains[key] = mains[param][0]
        if not self._params:
            raise ValueError("the policy has no adapters (model.lora)")
        self._master = {key: main.detach().float().clone() for key, main in self._mains.items()}
        self._values = {key: torch.empty_like(param) for key, param in self._params.items()}
        self.refresh()

    def averages(self, name: str) -> bool:
        """Whether the master holds the parameter ``name`` (a chunk's local name): the adapters'."""
        return is_adapter(name)

    def update(self) -> None:
        """``master <- tau * master + (1 - tau) * main`` (float32), then ``refresh()``; a main
        parameter that is not finite raises ValueError before anything changes."""
        keys = list(self._master)
        ema_update_([self._master[k] for k in keys], [self._mains[k].view_as(self._master[k]) for k in keys], self.tau)
        self.num_updates += 1
        if self.tau != 1:
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """The master cast into the anchor's adapter values."""
        for key, master in self._master.items():
            self._values[key].copy_(master.view_as(self._values[key]))

    @contextlib.contextmanager
    def forward_models(self) -> Iterator[list[torch.nn.Module]]:
        """The policy's chunks with the anchor's adapters in place of its own (swapped back after)."""
        with torch.no_grad():
            for key, param in self._params.items():
                param.data, self._values[key] = self._values[key], param.data
        try:
            yield self.policy_models
        finally:
            with torch.no_grad():
                for key, param in self._params.items():
                    param.data, self._values[key] = self._values[key], param.data

    def master_shards(self) -> dict[str, tuple[Tensor, int, int]]:
        """key -> (this rank's float32 master, 1-D, 0, numel): every adapter whole (``EmaAnchor``'s)."""
        return {key: (master, 0, master.numel()) for key, master in self._master.items()}

    def weight_bytes(self) -> int:
        """The bytes of the anchor's adapter values (its only weights: the base is the policy's)."""
        return sum(v.numel() * v.element_size() for v in self._values.values())

    def full_master_state(self, *, copy: bool = True) -> dict[str, Tensor]:
        """key ``"<chunk>.<name>"`` -> float32 master in the adapter's local shape."""
        views = {key: master.view(self._params[key].shape) for key, master in self._master.items()}
        return {key: view.clone() for key, view in views.items()} if copy else views

    def load_full_master_state(self, state: Mapping[str, Tensor]) -> None:
        """Set the master from ``full_master_state()``'s format, then ``refresh()``."""
        if set(state) != set(self._master):
            missing, extra = sorted(set(self._master) - set(state)), sorted(set(state) - set(self._master))
            raise KeyError(f"anchor master state: missing {missing[:8]}, unexpected {extra[:8]}")
        for key, master in self._master.items():
            if tuple(state[key].shape) != tuple(self._params[key].shape):
                raise ValueError(
                    f"{key}: shape {tuple(state[key].shape)}, the adapter's is {tuple(self._params[key].shape)}"
                )
            master.copy_(state[key].reshape(master.shape).to(torch.float32))
        self.refresh()
