"""A ``HfEngine`` that writes each call of the engine protocol to a JSONL file, and ``empg`` with it
registered as ``rollout.engine: recording``:

    EMPG_ENGINE_LOG=calls.jsonl python -m tests.trainer.recording_engine train CONFIG [overrides]

What the trainer asks of its engine, in order, as the tests see it (``test_engine_calls``)."""

from __future__ import annotations

import json
import os
import sys

from megatron_empg.rollout.engines import ENGINES, EngineKind
from megatron_empg.rollout.hf_engine import HfEngine


class RecordingEngine(HfEngine):
    """``HfEngine`` plus one JSON line per protocol call: ``[method, arguments]``."""

    def _record(self, method: str, **arguments) -> None:
        with open(os.environ["EMPG_ENGINE_LOG"], "a") as log:
            log.write(json.dumps([method, arguments]) + "\n")

    def generate(self, prompts, sampling):
        self._record("generate", prompts=len(prompts), n=sampling.n)
        return super().generate(prompts, sampling)

    def score(self, sequences):
        self._record("score", sequences=len(sequences))
        return super().score(sequences)

    def begin_weight_update(self):
        self._record("begin_weight_update")
        super().begin_weight_update()

    def update_weights(self, *, named_tensors=None, path=None):
        self._record("update_weights")
        super().update_weights(named_tensors=named_tensors, path=path)

    def finish_weight_update(self, version):
        self._record("finish_weight_update", version=version)
        super().finish_weight_update(version)

    def sleep(self, level=1):
        self._record("sleep", level=level)
        super().sleep(level)

    def wake_up(self, tags=None):
        self._record("wake_up", tags=tags)
        super().wake_up(tags)

    def shutdown(self):
        self._record("shutdown")
        super().shutdown()


if __name__ == "__main__":
    from megatron_empg.trainer.cli import main

    ENGINES["recording"] = EngineKind(
        "tests.trainer.recording_engine:RecordingEngine",
        own_process=False,
        in_process_beside_training=True,
        updates_mid_generation=False,
    )
    sys.exit(main(sys.argv[1:]))
