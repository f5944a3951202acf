"""What ``empg train`` checks on the machine before its engine starts (``Trainer._check_machine``):
room in ``/dev/shm`` for a weight-sync bucket file, a GPU with Transformer Engine for a TE FP8
anchor; and the FP8 anchor reached from YAML. Runs on the transformers engine, whose calls are
recorded: a refused run made none."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from megatron_empg.config import load_model_config
from megatron_empg.trainer.bind.memory_terms import bucket_file_bytes
from megatron_empg.weight_sync.transport import check_free_space
from tests.trainer.demo_runs import REPO, train_command
from tests.trainer.hf_runs import hf_engine_config, random_demo_model

pytestmark = [pytest.mark.megatron]

# empg train with the recording engine, and shutil.disk_usage reporting MiB_FREE MiB free; at exit
# (after every other atexit hook) the names of the process's threads go to THREADS_AT_EXIT.
_RUN = textwrap.dedent(
    """
    import atexit, collections, os, shutil, sys, runpy
    def threads_at_exit(path=os.environ["THREADS_AT_EXIT"]):
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        open(path, "w").write("\\n".join(names))
    atexit.register(threads_at_exit)
    free = os.environ.get("MIB_FREE")
    if free is not None:
        usage = collections.namedtuple("usage", "total used free")
        shutil.disk_usage = lambda path: usage(1 << 40, 0, int(free) << 20)
    sys.argv = ["recording_engine", *sys.argv[1:]]
    runpy.run_module("tests.trainer.recording_engine", run_name="__main__")
    """
)


def _train(tmp_path, config: dict, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    command, base_env = train_command(config, tmp_path, "run")
    log, threads = tmp_path / "calls.jsonl", tmp_path / "threads_at_exit"
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *command[3:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**base_env, **env, "EMPG_ENGINE_LOG": str(log), "THREADS_AT_EXIT": str(threads)},
        timeout=300,
    )
    calls = [json.loads(line)[0] for line in log.read_text().splitlines()] if log.exists() else []
    # Every process group is freed before interpreter teardown, where its gloo threads can abort the
    # process ("terminate called without an active exception": exit -6 after a clean run, seen in CI).
    left = [name for name in threads.read_text().split() if name.startswith(("gloo", "pt_gloo", "pt_tcpstore"))]
    assert left == [], f"process-group threads alive at exit: {left}"
    return out, calls


def test_the_bucket_file_is_at_least_the_largest_tensor_and_at_most_the_model():
    r1 = load_model_config("deepseek-r1-distill-qwen-1.5b")
    from megatron_empg.config import RunConfig, load_config

    config = load_config(RunConfig, REPO / "recipes" / "r1_distill_qwen_1.5b_math_ema_pg.yaml")
    assert bucket_file_bytes(config, r1) == 512 * 2**20 + 2**20  # bucket_size_mb 512 > the 467 MB embedding
    small = load_config(
        RunConfig, REPO / "recipes" / "r1_distill_qwen_1.5b_math_ema_pg.yaml", ["weight_sync.bucket_size_mb=64"]
    )
    assert bucket_file_bytes(small, r1) == 151936 * 1536 * 2 + 2**20  # the embedding goes alone
    tiny = load_model_config("tiny-qwen2")
    assert bucket_file_bytes(config, tiny) == 2 * tiny.num_parameters() + 2**20  # bf16: the whole model


def test_check_free_space_says_how_to_make_room(tmp_path):
    check_free_space(tmp_path, 1)
    with pytest.raises(Exception) as e:
        check_free_space(tmp_path, 1 << 60)
    assert e.value.field == "weight_sync.shm_dir" and "--ipc=host or --shm-size" in str(e.value)
    with pytest.raises(Exception, match="is not a directory"):
        check_free_space(tmp_path / "missing", 1)


@pytest.mark.process
def test_a_small_dev_shm_stops_the_run_before_the_engine_starts(tmp_path):
    config = hf_engine_config(tmp_path, "run", random_demo_model(tmp_path / "model"), steps=1)
    config["rollout"]["engine"] = "recording"
    config["weight_sync"].update(transport="shm_file", shm_dir=str(tmp_path))
    out, calls = _train(tmp_path, config, MIB_FREE="1")  # the demo model's bucket: its 2.1 MB
    assert out.returncode == 2 and calls == [], out.stderr[-3000:]
    assert (
        "empg: error: weight_sync.shm_dir: " in out.stderr and "has 1 MiB free but one weight-sync bucket" in out.stderr
    )
    out, calls = _train(tmp_path, config, MIB_FREE="64")  # Docker's default /dev/shm is enough for it
    assert out.returncode == 0 and calls[:3] == ["begin_weight_update", "update_weights", "finish_weight_update"], (
        out.stderr[-3000:]
    )


@pytest.mark.process
def test_the_fp8_anchor_from_yaml(tmp_path):
    config = hf_engine_config(tmp_path, "run", random_demo_model(tmp_path / "model"), steps=1)
    config["rollout"]["engine"] = "recording"
    config["algorithm"]["anchor"].update(compute_dtype="float8_e4m3fn", fp8="te")
    out, calls = _train(tmp_path, config)  # no GPU, no Transformer Engine here
    assert out.returncode == 2 and calls == [], out.stderr[-3000:]
    assert "empg: error: algorithm.anchor.fp8: te needs a GPU and Transformer Engine" in out.stderr
    config["algorithm"]["anchor"]["fp8"] = "auto"
    out, _ = _train(tmp_path, config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "EMA anchor: tau 0.95 every 2 optimizer steps, float8_e4m3fn weights, emulated storage (auto: no "
        "Transformer Engine; no GPU (the FP8 arithmetic, computed in float32))"
    ) in out.stderr


def test_cuda_ipc_needs_a_gpu_on_every_engine_owner():
    from megatron_empg.config import RunConfig, load_config
    from megatron_empg.trainer.bind.machine import check_machine

    config = load_config(
        RunConfig, REPO / "recipes" / "r1_distill_qwen_1.5b_math_ema_pg.yaml", ["weight_sync.transport=cuda_ipc"]
    )
    model = load_model_config("deepseek-r1-distill-qwen-1.5b")
    check_machine(config, model, engine_rank=False)  # a rank without an engine sends no handle
    with pytest.raises(Exception) as e:
        check_machine(config, model, engine_rank=True)  # no GPU here
    assert e.value.field == "weight_sync.transport" and "use shm_file without GPUs" in str(e.value)
