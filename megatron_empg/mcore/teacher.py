"""A frozen teacher for on-policy distillation: ``GPTModel`` chunks run forward only.

    teacher = FrozenTeacher.build(teacher_cfg, parallel, params_dtype=torch.bfloat16, load=fn, offload=False)
    with teacher.forward_models() as models:    # what mcore.step.forward_stats runs
        ...

The chunks are built at the run's TP / PP / VPP (the bind step checked that the teacher's heads,
query groups and layers split), without random initialization (``load`` writes every weight),
in eval mode with ``requires_grad=False``: no DDP, no optimizer, no gradient buffers, never synced
to an engine, never checkpointed (the teacher's weights are its ``checkpoint``). Building does not
move the run's random streams (so a run with a teacher samples and drops out as one without).
``offload`` keeps the weights in (pinned) host memory between passes on a GPU machine; on a CPU
machine it changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from megatron_empg.mcore.parallel_state import rng_preserved

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from megatron_empg.config import ModelConfig, ParallelConfig


class FrozenTeacher:
    """This rank's teacher chunks (module docstring)."""

    def __init__(self, models: list[GPTModel], *, offload: bool = False) -> None:
        self.models = models
        for chunk in models:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)
        self.device = next(models[0].parameters()).device
        self.offload = offload and self.device.type == "cuda"
        if self.offload:
            self._move(torch.device("cpu"))

    @classmethod
    def build(
        cls,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        *,
        params_dtype: torch.dtype,
        load: Callable[[list[GPTModel]], None],
        offload: bool = False,
        **build_kwargs: Any,
    ) -> FrozenTeacher:
        """Chunks of ``model_cfg`` by ``mcore.model.build_gpt_model`` (``build_kwargs`` too) in
        ``params_dtype``, their weights written by ``load(chunks)``; neither moves the run's random
        streams (CPU, CUDA and Megatron's tracker)."""
        from megatron_empg.mcore.model import build_gpt_model

        with rng_preserved():
            kwargs = {"perform_initialization": False, **build_kwargs}
            models = build_gpt_model(model_cfg, parallel, params_dtype=params_dtype, **kwargs)
            load(models)
        return cls(models, offload=offload)

    @contextlib.contextmanager
    def forward_models(self) -> Iterator[list[GPTModel]]:
        """The chunks the teacher pass runs, on the device for the pass (offloaded after it)."""
        if self.offload:
            self._move(self.device)
        try:
            yield self.models
        finally:
            if self.offload:
                self._move(torch.device("cpu"))

    @torch.no_grad()
    def _move(self, device: torch.device) -> None:
        for chunk in self.models:
            for p in chunk.parameters():
                if p.device != device:
                    if device.type == "cpu":
                        p.data = torch.empty_like(p.data, device="cpu", pin_memory=True).copy_(p.data)
                    else:
                        p.data = p.data.to(device)
            for b in chunk.buffers():
                if b.device != device:
                    b.data = b.data.to(device)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
