"""The CUDA IPC weight transport (``weight_sync.cuda_ipc``, its format ``parallel.cuda_ipc``) and the engines' ``update_weights(ipc=...)``.

On CPU: the bucket's layout in the flat buffer (bit-exact round trips of several dtypes and shapes),
the handle's plain form through vLLM's msgpack and its device rewrite by GPU UUID, the checks of a
description, ``check_update_arguments`` with three kinds, the engines' routing and refusals, the
"empg" backend's ``ipc`` kind on a CPU buffer, and the ``ConfigError`` without CUDA. On a GPU
(``gpu`` marker): buckets through the transport into a spawned process that sees the GPU as its
``cuda:0`` by UUID, bit-exact, with the buffer reused and grown, and its memory freed at ``finish``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from megatron_empg.config import ConfigError, WeightSyncConfig
from megatron_empg.parallel import cuda_ipc
from megatron_empg.rollout.engine import EngineState, check_update_arguments
from megatron_empg.weight_sync.transport import TRANSPORTS


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as ``uint8`` on CPU, in row-major order (any dtype, shape, layout and device)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def special_floats(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random values with a NaN, infinities and -0.0 in front: bit-exact, not just equal."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    values[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return values.to(dtype)


def mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes: odd byte counts (so alignment matters), a transposed
    (non-contiguous) one, a scalar, an empty one and a parameter that requires grad."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", special_floats(torch.bfloat16, 21, 1).reshape(3, 7)),
        ("model.norm.weight", special_floats(torch.float32, 5, 2)),
        ("model.layers.0.mlp.up_proj.weight", special_floats(torch.float16, 24, 3).reshape(4, 6).t()),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("bytes", torch.randint(0, 256, (3,), dtype=torch.uint8, generator=generator)),
        ("scale", torch.tensor(3.25, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("lm_head.weight", torch.nn.Parameter(special_floats(torch.float32, 12, 4).reshape(2, 6))),
    ]


def packed(bucket) -> tuple[list[list], torch.Tensor]:
    """The header and a CPU buffer holding ``bucket`` (pre-filled with 0xAB: nothing is zero by chance)."""
    header, nbytes = cuda_ipc.build_header(bucket)
    buffer = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    cuda_ipc.pack(bucket, header, buffer)
    return header, buffer


def assert_bit_exact(received, bucket) -> None:
    assert [name for name, _ in received] == [name for name, _ in bucket]
    for (name, got), (_, sent) in zip(received, bucket):
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(as_bytes(got), as_bytes(sent)), name


# --------------------------------------------------------------------------------------------
# The bucket's layout.


def test_pack_then_unpack_is_bit_exact_for_every_dtype_and_shape():
    bucket = mixed_bucket()
    header, buffer = packed(bucket)
    assert_bit_exact(cuda_ipc.unpack(buffer, header), bucket)


def test_header_offsets_are_aligned_in_order_and_do_not_overlap():
    bucket = mixed_bucket()
    header, nbytes = cuda_ipc.build_header(bucket)
    assert [entry[0] for entry in header] == [name for name, _ in bucket]
    assert [entry[1] for entry in header] == [str(t.dtype).removeprefix("torch.") for _, t in bucket]
    assert [entry[2] for entry in header] == [list(t.shape) for _, t in bucket]
    ends = [offset + t.numel() * t.element_size() for (_, _, _, offset), (_, t) in zip(header, bucket)]
    offsets = [entry[3] for entry in header]
    assert offsets[0] == 0 and all(offset % 256 == 0 for offset in offsets)
    assert all(end <= next_offset for end, next_offset in zip(ends, offsets[1:]))
    assert nbytes == ends[-1]


def test_unpacked_views_alias_the_buffer():
    """The engine must copy them before the trainer refills the buffer: they are views."""
    bucket = [("a", torch.ones(3)), ("b", torch.ones(2, dtype=torch.float16))]
    header, buffer = packed(bucket)
    views = dict(cuda_ipc.unpack(buffer, header))
    buffer.zero_()
    assert views["a"].eq(0).all() and views["b"].eq(0).all()


def test_pack_refuses_a_bucket_that_differs_from_its_header():
    header, nbytes = cuda_ipc.build_header([("a", torch.ones(3))])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pack: 'a' is torch.float32 \[4\], the header says torch.float32 \[3\]"):
        cuda_ipc.pack([("a", torch.ones(4))], header, buffer)
    with pytest.raises(ValueError, match="a bucket needs at least one tensor"):
        cuda_ipc.build_header([])


def test_unpack_refuses_a_tensor_past_the_end_of_the_buffer():
    header, buffer = packed([("a", torch.ones(4))])
    with pytest.raises(ValueError, match="'a' ends at byte 16, past the buffer's 12"):
        cuda_ipc.unpack(buffer[:12], header)


# --------------------------------------------------------------------------------------------
# The handle.


def reduce_args(storage_device: int = 3) -> tuple:
    """What ``reduce_tensor`` returns as arguments for a flat uint8 CUDA buffer, in its order
    (torch/multiprocessing/reductions.py), with made-up handles."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        storage_device,
        b"\x11" * 64,
        4096,
        512,
        False,
        b"/torch_123_456",
        7,
        b"\x22" * 64,
        True,
    )


def description(storage_device: int = 3, uuid: str = "GPU-trainer") -> dict:
    header, _ = cuda_ipc.build_header(mixed_bucket())
    handle = cuda_ipc.handle_to_wire(rebuild_cuda_tensor, reduce_args(storage_device))
    return {"gpu_uuid": uuid, "handle": handle, "header": header}


def test_rebuild_args_rewrite_only_the_device_index_by_uuid():
    args = cuda_ipc.rebuild_args(description(storage_device=3), {"GPU-other": 0, "GPU-trainer": 1})
    expected = list(reduce_args())
    expected[6] = 1  # storage_device: the trainer's cuda:3 is this process's cuda:1
    assert args == tuple(expected)


def test_rebuild_args_refuse_a_gpu_this_process_does_not_see():
    with pytest.raises(ValueError, match="on GPU GPU-trainer, which this process does not see .*'GPU-other'"):
        cuda_ipc.rebuild_args(description(), {"GPU-other": 0})


def test_handle_to_wire_refuses_other_tensors():
    with pytest.raises(ValueError, match="expected the handle of a CUDA tensor"):
        cuda_ipc.handle_to_wire(torch.tensor, reduce_args())
    float_buffer = list(reduce_args())
    float_buffer[5] = torch.float32
    with pytest.raises(ValueError, match="expected the handle of a flat uint8 buffer"):
        cuda_ipc.handle_to_wire(rebuild_cuda_tensor, tuple(float_buffer))


def test_description_crosses_vllm_msgpack_without_pickle(monkeypatch):
    """vLLM carries the update info to its engine core over msgpack; without
    VLLM_ALLOW_INSECURE_SERIALIZATION it refuses functions, classes and dtypes."""
    try:
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    except Exception as error:  # not installed, or broken
        pytest.skip(f"vLLM is not importable: {type(error).__name__}: {error}")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    sent = {"update_info": {"ipc": description()}}
    received = MsgpackDecoder().decode(MsgpackEncoder().encode(sent))["update_info"]["ipc"]
    cuda_ipc.check_description(received)
    uuids = {"GPU-trainer": 0}
    assert cuda_ipc.rebuild_args(received, uuids) == cuda_ipc.rebuild_args(sent["update_info"]["ipc"], uuids)
    with pytest.raises(TypeError, match="not serializable"):  # what the plain form avoids
        MsgpackEncoder().encode({"args": reduce_args()})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("gpu_uuid"), r"ipc: expected the keys \['gpu_uuid', 'handle', 'header'\]"),
        (lambda d: d.update(gpu_uuid=""), r"ipc\['gpu_uuid'\]: expected a GPU UUID string"),
        (lambda d: d["handle"].pop("storage_handle"), r"ipc\['handle'\]: expected the keys"),
        (lambda d: d.update(header=[]), r"ipc\['header'\]: expected a non-empty list"),
        (lambda d: d["header"][1].__setitem__(1, "float33"), r"ipc\['header'\]\[1\]: 'float33' is not a torch dtype"),
        (lambda d: d["header"][1].__setitem__(3, 8), r"ipc\['header'\]\[1\]: expected an offset >= 0 that is a mult"),
        (lambda d: d["header"][1].__setitem__(2, [-1]), r"ipc\['header'\]\[1\]: expected the shape as a list"),
        (lambda d: d["header"][2].__setitem__(0, "model.norm.weight"), r"\[2\]: expected a new non-empty hf_name"),
        (lambda d: d["header"][0].pop(), r"ipc\['header'\]\[0\]: expected \[hf_name, dtype_name, shape, offset\]"),
    ],
)
def test_check_description_names_what_is_wrong(change, message):
    bad = description()
    cuda_ipc.check_description(bad)
    change(bad)
    with pytest.raises(ValueError, match=message):
        cuda_ipc.check_description(bad)


def test_check_description_wants_a_dict():
    with pytest.raises(TypeError, match="ipc: expected a dict describing a CUDA IPC bucket, got list"):
        cuda_ipc.check_description([description()])


# --------------------------------------------------------------------------------------------
# update_weights(ipc=...): the argument check and the engines.


def test_check_update_arguments_takes_exactly_one_of_three(tmp_path):
    pairs = [("lm_head.weight", torch.zeros(2))]
    path = tmp_path / "bucket.safetensors"
    path.write_bytes(b"")
    ipc = description()
    assert check_update_arguments(pairs, None) == pairs
    assert check_update_arguments(None, path) is None
    assert check_update_arguments(None, None, ipc) is None
    for given, arguments in [
        ("none", (None, None, None)),
        ("named_tensors and path", (pairs, path, None)),
        ("named_tensors and ipc", (pairs, None, ipc)),
        ("path and ipc", (None, path, ipc)),
        ("named_tensors and path and ipc", (pairs, path, ipc)),
    ]:
        with pytest.raises(ValueError, match=f"exactly one of named_tensors, path and ipc, got {given}$"):
            check_update_arguments(*arguments)
    ipc["header"][0][1] = "float33"
    with pytest.raises(ValueError, match=r"update_weights: ipc\['header'\]\[0\]: 'float33' is not a torch dtype"):
        check_update_arguments(None, None, ipc)


class RecordingLlm:
    """Stands in for vLLM's ``LLM`` in ``VllmEngine.update_weights``: records the update info."""

    llm_engine = SimpleNamespace(engine_core=None)  # no engine-core process to watch

    def __init__(self) -> None:
        self.updates: list[dict] = []

    def update_weights(self, request: dict) -> None:
        self.updates.append(request["update_info"])


def vllm_engine_in_an_update(in_process: bool):
    """A ``VllmEngine`` with an update begun and a recording ``LLM`` (no vLLM started)."""
    from megatron_empg.rollout.vllm_engine import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)
    engine._state, engine._in_process, engine._llm = EngineState(), in_process, RecordingLlm()
    engine._state.update_open = True
    return engine


def test_vllm_engine_forwards_ipc_from_another_process_only():
    engine = vllm_engine_in_an_update(in_process=False)
    engine.update_weights(ipc=description())
    assert engine._llm.updates == [{"ipc": description()}]
    engine = vllm_engine_in_an_update(in_process=True)
    with pytest.raises(ValueError, match=r"ipc needs an engine in another process \(rollout.in_process=False\)"):
        engine.update_weights(ipc=description())
    assert engine._llm.updates == [] and engine._state.broken is None


def test_hf_engine_refuses_ipc_naming_the_transport(tmp_path):
    from megatron_empg.config import RolloutConfig, load_model_config
    from megatron_empg.rollout.hf_engine import HfEngine
    from tools.make_tiny_model import save_tiny_hf_model

    engine = HfEngine(save_tiny_hf_model(load_model_config("tiny-qwen3"), tmp_path), RolloutConfig(dtype="float32"))
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="HfEngine runs in the trainer's process .* weight_sync.transport=in_process"):
        engine.update_weights(ipc=description())
    assert engine._state.broken is None


# --------------------------------------------------------------------------------------------
# The "empg" vLLM backend's ipc kind, on a CPU buffer (mapping it needs CUDA: replaced here).


class RecordingModel:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights) -> None:
        self.loaded.extend(weights)


@pytest.fixture
def backend():
    try:
        from megatron_empg.rollout.vllm_weight_transfer import engine_class

        engine_cls = engine_class()
    except Exception as error:  # vLLM not installed, or broken
        pytest.skip(f"vLLM is not importable: {type(error).__name__}: {error}")
    vllm_config = SimpleNamespace(parallel_config=None, model_config=None)
    return engine_cls(None, vllm_config, torch.device("cpu"), RecordingModel())


def test_backend_loads_copies_of_an_ipc_bucket_and_waits_for_them(backend, monkeypatch):
    bucket = mixed_bucket()
    header, buffer = packed(bucket)
    opened, synchronized = [], []
    monkeypatch.setattr(cuda_ipc, "open_bucket", lambda d: opened.append(d) or buffer)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    sent = description()
    assert sent["header"] == header
    backend.update_weights({"ipc": sent})
    assert opened == [sent] and synchronized == [torch.device("cpu")]
    assert_bit_exact(backend.model.loaded, bucket)
    buffer.fill_(0xCD)  # the next bucket: the loaded tensors are copies
    assert_bit_exact(backend.model.loaded, bucket)


def test_backend_takes_exactly_one_kind(backend):
    with pytest.raises(ValueError, match="exactly one of 'named_tensors', 'path' and 'ipc'"):
        backend.update_weights({"named_tensors": [("a", torch.zeros(1))], "ipc": description()})
    with pytest.raises(ValueError, match="exactly one of 'named_tensors', 'path' and 'ipc'"):
        backend.update_weights({})


# --------------------------------------------------------------------------------------------
# Building the transport.


def test_building_cuda_ipc_without_cuda_raises_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="cuda_ipc needs CUDA GPUs .* use shm_file on CPU") as caught:
        TRANSPORTS["cuda_ipc"](object(), WeightSyncConfig(transport="cuda_ipc"))
    assert caught.value.field == "weight_sync.transport"


# --------------------------------------------------------------------------------------------
# GPU: buckets into another process that sees the GPU as its cuda:0.


def _engine_process(requests, replies) -> None:
    """A stand-in engine: maps each bucket by UUID and keeps the copies ``receive_bucket`` makes;
    at "finish", sends them all back on CPU (a copy that aliased the buffer would show a later
    bucket's bytes by then), then waits for "bye": the CPU tensors travel as file descriptors that
    this process serves until the trainer has unpickled them."""
    assert torch.cuda.device_count() == 1  # CUDA_VISIBLE_DEVICES narrowed to the trainer's GPU
    kept = []
    while True:
        kind, payload = requests.get()
        if kind == "bye":
            return
        if kind == "finish":
            replies.put([(name, tensor.cpu()) for name, tensor in kept])
            continue
        kept.extend(cuda_ipc.receive_bucket(payload, torch.device("cuda", 0)))
        replies.put("loaded")


class ProcessEngine:
    """The trainer's side of ``_engine_process``: ``update_weights`` returns once the bucket is loaded."""

    def __init__(self, requests, replies) -> None:
        self.requests, self.replies, self.received = requests, replies, None

    def begin_weight_update(self) -> None:
        pass

    def update_weights(self, *, ipc) -> None:
        self.requests.put(("bucket", ipc))
        assert self.replies.get(timeout=60) == "loaded"

    def finish_weight_update(self, version: str) -> None:
        self.requests.put(("finish", version))
        self.received = self.replies.get(timeout=60)
        self.requests.put(("bye", None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_buckets_reach_a_process_that_sees_the_gpu_by_uuid_bit_exactly():
    device = torch.cuda.device_count() - 1  # with several GPUs, the child's cuda:0 is not the trainer's index
    torch.cuda.set_device(device)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    buckets = [
        [(name, tensor.to(device)) for name, tensor in mixed_bucket()],
        [("small", special_floats(torch.bfloat16, 8, 5).to(device))],  # reuses the buffer, overwriting bucket 0
        [("large", special_floats(torch.float32, 1 << 20, 6).to(device))],  # grows it
    ]
    context = torch.multiprocessing.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"}):
        child = context.Process(target=_engine_process, args=(requests, replies), daemon=True)
        child.start()
    try:
        engine = ProcessEngine(requests, replies)
        transport = TRANSPORTS["cuda_ipc"](engine, WeightSyncConfig(transport="cuda_ipc"))
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(device)
        transport.begin()
        pointers = []
        for bucket in buckets:
            transport.send(bucket)
            pointers.append(transport._buffer.data_ptr())
        transport.finish("step-1")
        assert pointers[0] == pointers[1] != pointers[2]
        assert_bit_exact(engine.received, [item for bucket in buckets for item in bucket])
        child.join(timeout=60)
        assert child.exitcode == 0
        # Every export's reference count was released, so freeing the buffer freed its memory.
        assert transport._buffer is None and torch.cuda.memory_allocated(device) == baseline
    finally:
        if child.is_alive():
            child.kill()
