"""The multi-host step channel carries typed messages only: every op round-trips exactly, and a
message that is not one of ours (a pickle, an unknown op, a disallowed array dtype, bytes that do
not match a shape, a replica out of range) is refused before any object of it is built."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec
import numpy as np
import pytest

from myserve.runtime.step_channel import StepChannelError, decode_step, encode_step
from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import ClearSlot, CompileSteps, CopyPage, StepCall, WriteSlot

SHAPE = StepShape.of(8, max_num_seqs=4, block_tokens=4, max_pages=8, chunk_pages=4)


def _ops() -> list:
    ids = np.arange(256, dtype=np.int32)
    call = StepCall(
        np.arange(40, dtype=np.int32),
        SHAPE,
        np.ones((4, 3), np.int32),
        np.full((4, 5), 0.5, np.float32),
        np.array([[-1, 7]], np.int32),
        np.array([2], np.int32),
    )
    return [
        CopyPage(1, 2),
        ClearSlot(3),
        WriteSlot(3, ids, 17, True),
        CompileSteps((SHAPE,)),
        call,
        StepCall(np.zeros(0, np.int32), SHAPE, np.zeros((4, 3), np.int32), np.zeros((4, 5), np.float32)),
    ]


def _same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())  # type: ignore[union-attr]
    if isinstance(a, msgspec.Struct):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_every_op_round_trips_exactly() -> None:
    ops = _ops()
    replica, got = decode_step(encode_step(1, ops), replicas=2)
    assert replica == 1 and _same(got, ops)


class _Marker:
    """Unpickling this would create a file: proof of code run on the follower."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.path,))


def test_a_pickled_message_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    forged = pickle.dumps((0, [_Marker(marker)]), protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(StepChannelError, match="refused a step-channel message"):
        decode_step(forged, replicas=1)
    assert not marker.exists()


@pytest.mark.parametrize(
    "message",
    [
        [0, [{"type": "RunShell", "cmd": "true"}]],  # an op we do not have
        [0, [{"type": "CopyPage", "src": "1", "dst": 2}]],  # no coercion of types
        [0, [{"type": "ClearSlot", "slot": 1, "extra": 2}]],
        [0, [{"type": "WriteSlot", "slot": 0, "ids": ["|O", [1], b"\x00" * 8], "n": 1, "to_prompt": True}]],
        [0, [{"type": "WriteSlot", "slot": 0, "ids": ["<i4", [4], b"\x00" * 8], "n": 1, "to_prompt": True}]],
        [0, [{"type": "WriteSlot", "slot": 0, "ids": ["<i4", [-1], b""], "n": 1, "to_prompt": True}]],
        [5, [{"type": "ClearSlot", "slot": 1}]],  # no such replica
        {"replica": 0, "ops": []},
    ],
)
def test_a_malformed_or_foreign_message_is_refused(message: object) -> None:
    with pytest.raises(StepChannelError):
        decode_step(msgspec.msgpack.encode(message), replicas=2)


def test_the_stop_message_and_garbage_are_told_apart() -> None:
    with pytest.raises(StepChannelError):
        decode_step(b"\xc1\x00garbage", replicas=1)


class _Channel:
    def __init__(self, messages: list[bytes | None]):
        self.messages = messages

    def recv(self) -> bytes | None:
        return self.messages.pop(0)


class _Executor:
    def __init__(self) -> None:
        self.ran: list[list] = []

    def run(self, ops: list) -> None:
        self.ran.append(ops)


def test_a_follower_runs_its_leader_s_steps_and_stops_at_a_foreign_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from myserve.runtime import multihost

    marker = tmp_path / "ran"
    forged = pickle.dumps((0, [_Marker(marker)]))
    executor = _Executor()
    good = encode_step(0, [ClearSlot(1)])
    monkeypatch.setattr(multihost, "_channel", _Channel([good, forged, good]))
    with pytest.raises(StepChannelError):
        multihost.follow([executor])  # type: ignore[list-item]
    assert executor.ran == [[ClearSlot(1)]] and not marker.exists()  # the good step only
    monkeypatch.setattr(multihost, "_channel", _Channel([good, None]))
    assert multihost.follow([executor]) == 1  # the leader's stop ends the loop
