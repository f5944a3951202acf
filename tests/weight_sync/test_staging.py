"""``weight_sync.staging``: weight updates held in host memory until the engine's thread takes the
newest one, the waits on it, and loading a staged update through a transport."""

from __future__ import annotations

import threading

import torch

from megatron_empg.trainer.batching.batch import version_name, version_step
from megatron_empg.weight_sync.staging import StagedUpdate, WeightStage, load_staged
from megatron_empg.weight_sync.transport import pack_bucket, receive_weights, unpack_bucket


def make_buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Two buckets of HF-named tensors of several dtypes and shapes, different for each seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            ("model.embed_tokens.weight", torch.randn(5, 4, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
        ],
        [("model.norm.weight", torch.randn(4, generator=g, dtype=torch.float64))],
    ]


def stage_update(stage: WeightStage, step: int, buckets) -> None:
    """One whole update into ``stage``, as ``receive_weights`` delivers it."""
    stage.begin()
    for bucket in buckets:
        stage.send(bucket)
    stage.finish(version_name(step))


def assert_same_buckets(got, expected) -> None:
    assert [[name for name, _ in bucket] for bucket in got] == [[name for name, _ in bucket] for bucket in expected]
    for got_bucket, expected_bucket in zip(got, expected):
        for (name, g), (_, e) in zip(got_bucket, expected_bucket):
            assert g.dtype == e.dtype and g.device.type == "cpu", name
            assert torch.equal(g, e), name


def test_an_empty_stage_has_nothing_to_take():
    stage = WeightStage(version_step)
    assert stage.newest == -1
    assert stage.take() is None


def test_take_gives_only_the_newest_update_and_only_once():
    stage = WeightStage(version_step)
    first, second = make_buckets(1), make_buckets(2)
    stage_update(stage, 1, first)
    stage_update(stage, 2, second)
    assert stage.newest == 2

    update = stage.take()
    assert isinstance(update, StagedUpdate) and update.version == "step-2"
    assert_same_buckets(update.buckets, second)  # step-1's update was dropped, not merged

    assert stage.take() is None
    assert stage.newest == 2  # newest counts updates completed, taken or not


def test_each_update_is_taken_when_taken_between_them():
    stage = WeightStage(version_step)
    stage_update(stage, 1, make_buckets(1))
    assert stage.take().version == "step-1"
    stage_update(stage, 2, make_buckets(2))
    update = stage.take()
    assert update.version == "step-2"
    assert_same_buckets(update.buckets, make_buckets(2))


def test_send_copies_the_link_buffer_it_is_given():
    # receive_weights hands the stage views of one receive buffer that the next bucket overwrites
    stage = WeightStage(version_step)
    bucket = make_buckets(3)[0]
    header, buffer = pack_bucket(bucket)
    stage.begin()
    stage.send(unpack_bucket(header, buffer))
    buffer.copy_(pack_bucket(make_buckets(4)[0])[1])  # the next bucket lands in the same buffer
    stage.finish("step-1")
    assert_same_buckets(stage.take().buckets, [bucket])


def test_send_copies_a_tensor_mutated_in_place_after_it():
    stage = WeightStage(version_step)
    source = torch.arange(6, dtype=torch.float32)
    stage.begin()
    stage.send([("w", source)])
    source.add_(100.0)
    stage.finish("step-1")
    assert torch.equal(stage.take().buckets[0][0][1], torch.arange(6, dtype=torch.float32))


class FakeLink:
    """The engine owner's end of a ``LinkTransport`` update, replayed from what rank 0 would send."""

    device = torch.device("cpu")

    def __init__(self, updates) -> None:
        self.objects, self.tensors = [], []
        for step, buckets in updates:
            for bucket in buckets:
                header, flat = pack_bucket(bucket)
                self.objects.append(("bucket", header, flat.numel()))
                self.tensors.append(flat)
            self.objects.append(("end", version_name(step)))

    def broadcast_object(self, obj=None, *, src: int):
        return self.objects.pop(0)

    def broadcast_tensor(self, tensor, *, src: int):
        tensor.copy_(self.tensors.pop(0))
        return tensor


def test_receive_weights_into_a_stage_keeps_every_bucket_intact():
    # receive_weights reuses one buffer for all buckets: each staged tensor must still be its own
    first = make_buckets(5)
    stage = WeightStage(version_step)
    version, received = receive_weights(FakeLink([(7, first)]), stage)
    assert version == "step-7" and stage.newest == 7
    assert received == sum(pack_bucket(b)[1].numel() for b in first)
    assert_same_buckets(stage.take().buckets, first)


def asleep_waiter(stage: WeightStage, holds) -> tuple[threading.Thread, list[bool]]:
    """A thread in ``stage.wait(holds)`` with no timeout (a timeout would re-check and pass anyway:
    only a notification can wake it), returned once it has seen ``holds()`` false; its result list."""
    checked = threading.Event()

    def condition():
        result = holds()
        checked.set()
        return result

    results = []
    waiter = threading.Thread(target=lambda: results.append(stage.wait(condition)), daemon=True)
    waiter.start()
    assert checked.wait(10)
    return waiter, results


def test_wait_wakes_when_another_thread_finishes_an_update():
    stage = WeightStage(version_step)
    waiter, results = asleep_waiter(stage, lambda: stage.newest >= 3)
    stage_update(stage, 3, make_buckets(3))  # takes the stage's lock, so the waiter is already asleep
    waiter.join(10)
    assert not waiter.is_alive(), "finish did not wake the waiter"
    assert results == [True]
    assert stage.newest == 3


def test_wait_gives_false_when_the_condition_stays_false():
    stage = WeightStage(version_step)
    stage_update(stage, 1, make_buckets(1))
    assert stage.wait(lambda: stage.newest >= 2, timeout=0.1) is False


def test_wait_gives_true_at_once_when_the_condition_already_holds():
    stage = WeightStage(version_step)
    stage_update(stage, 2, make_buckets(2))
    assert stage.wait(lambda: stage.newest >= 2, timeout=0) is True


def test_notify_wakes_a_waiter_whose_condition_another_thread_made_true():
    stage = WeightStage(version_step)
    flag = threading.Event()
    waiter, results = asleep_waiter(stage, flag.is_set)
    flag.set()  # e.g. the listener queued a request: no update completes
    stage.notify()
    waiter.join(10)
    assert not waiter.is_alive(), "notify did not wake the waiter"
    assert results == [True]
    assert stage.newest == -1


class RecordingTransport:
    """A ``Transport`` that records its calls, with copies of the buckets it was sent."""

    def __init__(self) -> None:
        self.calls = []

    def begin(self) -> None:
        self.calls.append(("begin",))

    def send(self, bucket) -> None:
        self.calls.append(("send", [(name, t.clone()) for name, t in bucket]))

    def finish(self, version: str) -> None:
        self.calls.append(("finish", version))


def test_load_staged_sends_every_bucket_in_order_and_counts_bytes():
    stage = WeightStage(version_step)
    buckets = make_buckets(6)
    stage_update(stage, 4, buckets)
    update = stage.take()
    transport = RecordingTransport()

    loaded = load_staged(update, transport)

    assert [call[0] for call in transport.calls] == ["begin", "send", "send", "finish"]
    assert_same_buckets([call[1] for call in transport.calls[1:-1]], buckets)
    assert transport.calls[-1] == ("finish", "step-4")
    # fp32 5x4 + bf16 4x4 + fp64 4
    assert loaded == 20 * 4 + 16 * 2 + 4 * 8
    assert loaded == sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def test_load_staged_of_an_update_without_buckets_still_finishes():
    transport = RecordingTransport()
    assert load_staged(StagedUpdate("step-9", []), transport) == 0
    assert transport.calls == [("begin",), ("finish", "step-9")]
