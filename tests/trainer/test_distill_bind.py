"""``algorithm.distill`` at bind (``trainer.bind.distill``): each refusal names its field (and, for the
vocabulary and the tokenizer, both models'); the bound loss carries the term; ``empg plan`` counts
the teacher."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_empg.config import ConfigError, RunConfig, load_config, load_model_config, to_dict
from megatron_empg.trainer.bind.build import bind
from megatron_empg.trainer.bind.distill import check_teacher_tokenizer, tokenizer_fingerprint
from tests.trainer.demo_runs import DEMO_RECIPE

TEACHER = "algorithm.distill={teacher: {model: demo-qwen2, checkpoint: /tmp/teacher}}"


def demo(tmp_path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", f"tokenizer={tmp_path}", *overrides])


def refused(config: RunConfig, world_size: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        bind(config, world_size=world_size, check_paths=False)
    return error.value


def test_a_teacher_binds_into_the_update_loss(tmp_path):
    components = bind(
        demo(tmp_path, TEACHER, "algorithm.distill.loss=k3", "algorithm.distill.use_policy_gradient=false"),
        1,
        check_paths=False,
    )
    term = components.loss_fn.keywords["distill"]
    assert term is components.distill.term and term.loss.name == "k3" and not term.use_policy_gradient
    assert components.distill.model.name == "demo-qwen2"
    assert bind(demo(tmp_path), 1, check_paths=False).distill is None  # negative control


def test_the_engine_placement_binds_a_hf_teacher_and_refuses_a_megatron_checkpoint(tmp_path):
    from tools.make_tiny_model import save_tiny_hf_model

    student = save_tiny_hf_model(load_model_config("demo-qwen2"), tmp_path / "student", seed=0)
    teacher_hf = student  # a HF directory of the teacher's model config, with the student's tokenizer
    engine = ("algorithm.distill.placement=engine", "rollout.engine=hf")
    spec = f"algorithm.distill={{teacher: {{model: demo-qwen2, checkpoint: {teacher_hf}}}}}"
    components = bind(demo(student, spec, *engine), 1)
    assert components.distill.placement.on_engines and components.distill.placement.name == "engine"
    assert not bind(demo(student, spec), 1).distill.placement.on_engines  # the trainer placement
    megatron = tmp_path / "megatron_checkpoint"  # a directory without config.json
    megatron.mkdir()
    spec = f"algorithm.distill={{teacher: {{model: demo-qwen2, checkpoint: {megatron}}}}}"
    with pytest.raises(ConfigError) as error:
        bind(demo(student, spec, *engine), 1)
    assert error.value.field == "algorithm.distill.teacher.checkpoint" and "Megatron checkpoint" in error.value.reason
    error = refused(demo(tmp_path, TEACHER, *engine, "algorithm.distill.teacher.offload=true"))
    assert error.field == "algorithm.distill.teacher.offload"
    assert components.distill.context == 32 + 1  # train.max_seq_len, below rollout.max_model_len 128


def test_an_engine_teacher_needs_one_position_past_the_longest_sample(tmp_path):
    # the demo's samples have at most train.max_seq_len = 32 tokens; an engine scores one as a prompt
    teacher = f"algorithm.distill.teacher.model={_teacher_yaml(tmp_path, max_position_embeddings=32)}"
    assert bind(demo(tmp_path, TEACHER, teacher), 1, check_paths=False).distill.context == 33  # trainer: fits
    error = refused(demo(tmp_path, TEACHER, teacher, "algorithm.distill.placement=engine"))
    assert error.field == "algorithm.distill.teacher.model" and "max_position_embeddings 32" in error.reason
    error = refused(
        demo(
            tmp_path,
            TEACHER,
            "algorithm.distill.placement=engine",
            "algorithm.distill.teacher.gpu_memory_utilization=0.6",
        )
    )
    assert error.field == "algorithm.distill.teacher.gpu_memory_utilization"  # 0.6 beside the engine's 0.5


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path):
    error = refused(demo(tmp_path, TEACHER, "algorithm.distill.teacher.model=tiny-qwen2"))
    assert error.field == "algorithm.distill.teacher.model"
    assert "tiny-qwen2" in error.reason and "demo-qwen2" in error.reason and "250" in error.reason


def _teacher_yaml(tmp_path, **changes) -> str:
    data = {**to_dict(load_model_config("demo-qwen2")), "name": "demo-teacher", **changes}
    path = tmp_path / "teacher.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_teacher_whose_layers_do_not_split_over_pp_is_refused(tmp_path):
    pp2 = ["parallel.pipeline_model_parallel_size=2", "rollout.in_process=false", "weight_sync.transport=shm_file"]
    teacher = _teacher_yaml(tmp_path, num_layers=3)
    error = refused(demo(tmp_path, TEACHER, f"algorithm.distill.teacher.model={teacher}", *pp2), world_size=2)
    assert error.field == "algorithm.distill.teacher.model" and "num_layers" in error.reason, error
    even = _teacher_yaml(tmp_path, num_layers=4)  # negative control: 4 layers split over PP 2
    bind(demo(tmp_path, TEACHER, f"algorithm.distill.teacher.model={even}", *pp2), world_size=2, check_paths=False)


def test_topk_beyond_the_vocabulary_is_refused(tmp_path):
    error = refused(demo(tmp_path, TEACHER, "algorithm.distill.topk=129"))
    assert error.field == "algorithm.distill.topk"


def _tokenizer(directory, vocab: dict) -> str:
    directory.mkdir()
    (directory / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": []})
    )
    return str(directory)


def test_a_teacher_tokenizer_of_other_ids_is_refused_naming_both(tmp_path):
    student = _tokenizer(tmp_path / "student", {"a": 0, "b": 1})
    other = _tokenizer(tmp_path / "other", {"a": 1, "b": 0})
    same = _tokenizer(tmp_path / "same", {"b": 1, "a": 0})  # the same map, written in another order
    config = demo(student, TEACHER, f"algorithm.distill.teacher.tokenizer={other}")
    with pytest.raises(ConfigError) as error:
        check_teacher_tokenizer(config)
    assert error.value.field == "algorithm.distill.teacher.tokenizer"
    assert student in error.value.reason and other in error.value.reason
    check_teacher_tokenizer(demo(student, TEACHER, f"algorithm.distill.teacher.tokenizer={same}"))
    assert tokenizer_fingerprint(tmp_path) is None  # no tokenizer files: refused as such
    with pytest.raises(ConfigError, match="holds no tokenizer files"):
        check_teacher_tokenizer(demo(student, TEACHER, f"algorithm.distill.teacher.tokenizer={tmp_path}"))


def test_the_plan_counts_the_teacher(tmp_path):
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    def training_rank(*overrides):
        plan = plan_memory(bind(demo(tmp_path, *overrides), 1, check_paths=False))
        return next(r for r in plan.ranks if r.kind.startswith("training"))

    teacher = _teacher_yaml(tmp_path, num_layers=4)
    without = training_rank()
    held = training_rank(
        TEACHER, f"algorithm.distill.teacher.model={teacher}", "algorithm.distill.teacher.dtype=float32"
    )
    params = load_model_config(teacher).num_parameters()
    assert "teacher_weights" not in without.resident
    # the teacher's parameters (its vocabulary padded to 128: demo-qwen2's is already) in float32
    assert held.resident["teacher_weights"] == 4 * params
    assert held.phases["teacher_pass"]["logits"] > 0
    offloaded = training_rank(TEACHER, "algorithm.distill.teacher.offload=true")
    assert offloaded.resident["teacher_weights"] == 0 and offloaded.phases["teacher_pass"]["teacher_weights"] > 0
    # placement engine: nothing on the training ranks' allocator; the teacher engine beside the
    # rollout engine (vLLM, the demo's engine): its GPU share awake in the rollout, asleep after it
    engine = training_rank(TEACHER, "algorithm.distill.placement=engine", "algorithm.distill.teacher.dtype=float32")
    assert "teacher_weights" not in engine.resident and engine.phases["teacher_pass"] == {}
    device = engine.device["rollout"]["teacher_engine_awake"]
    assert device > 0 and abs(device - 0.4 * without.device["rollout"]["engine_awake"]) <= 1  # 0.2 vs the engine's 0.5
    assert "teacher_engine_awake" not in engine.device["update"] and engine.device["update"]["teacher_engine_asleep"]
    hf = training_rank(
        TEACHER, "algorithm.distill.placement=engine", "algorithm.distill.teacher.dtype=float32", "rollout.engine=hf"
    )
    assert hf.device["rollout"]["teacher_engine_weights"] == 4 * load_model_config("demo-qwen2").num_parameters()
