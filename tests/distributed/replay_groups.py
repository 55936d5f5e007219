"""Record what one rank sends and receives in a real multi-process run, and replay it to the same rank run alone.

Two process-group backends for tests/distributed/test_rank_replay.py:

- ``recording``: every group is a real gloo group; each exchange is logged, in order, in the log of its group: a copy
  of what this rank contributed (its inputs, its sends) and, once the exchange completed, of what it received.
  Groups are numbered by their creation, which the program fixes: the same program creates the same groups in the
  same order in every process.
- ``replaying``: one process acting as a rank of a world that does not exist. Each exchange takes the next entry of
  its group's log and writes the recorded values into its outputs. The entry must be of the same kind and shapes: a
  program that issues another exchange than the recorded one diverged from it, and the replay stops there
  (``ReplayMismatch``). What the rank contributes is compared with what the real rank contributed
  (``differences``).

The comparison of contributions is the substance of the check. Whatever the rank reports after an exchange that
sums over ranks (the step's loss, the gradient norm, a gradient FSDP reduce-scatters) is the replayed sum, equal by
construction; what it computed is what it put into that exchange.

Exchanges the real rank makes and the rank run alone answers itself (its pipeline's shape agreement, its expert
counts under the mirrored assumption) run ``unrecorded()``; the caller says which.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                                AllToAllOptions, BarrierOptions, BroadcastOptions,
                                                ReduceScatterOptions)
from torch.futures import Future

Metas = tuple[tuple[tuple[int, ...], str], ...]


@dataclass
class Exchange:
    """One operation of one group as this rank saw it: its kind, the (shape, dtype) of each output, what this rank
    contributed and what it received (None for sends and barriers)."""

    op: str
    metas: Metas
    sent: list[torch.Tensor]
    received: list[torch.Tensor] | None = None


class ReplayMismatch(RuntimeError):
    """The replayed program issued an exchange other than the recorded one at this position."""


def _metas(tensors: list[torch.Tensor]) -> Metas:
    return tuple((tuple(t.shape), str(t.dtype)) for t in tensors)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class _Done(dist.Work):
    """A work already complete: the replay's values are in place when the call returns."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(None)
        return future


class _RecordOnWait(dist.Work):
    """A receive logged when the program waits for it: a pipeline posts its receives and sends together, and a gloo
    send may not finish before the peer posts its receive, so waiting at the call could deadlock."""

    def __init__(self, inner: dist.Work, tensors: list[torch.Tensor], entry: Exchange) -> None:
        super().__init__()
        self._inner, self._tensors, self._entry = inner, tensors, entry

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._inner.wait()
        if self._entry.received is None:
            self._entry.received = _copies(self._tensors)
        return True

    def is_completed(self) -> bool:
        return self._entry.received is not None

    def get_future(self) -> Future:
        self.wait()
        return _Done().get_future()


@dataclass
class _Session:
    """This process's logs, one per group in creation order (filled by recording, read by replaying), and what the
    replay found."""

    logs: list[list[Exchange]] = field(default_factory=list)
    paused: bool = False
    replay_groups: list[ReplayGroup] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)


_SESSION = _Session()


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Exchanges in this block reach the real peers but are not logged (the rank run alone makes none of them)."""
    previous, _SESSION.paused = _SESSION.paused, True
    try:
        yield
    finally:
        _SESSION.paused = previous


Start = Callable[[dist.ProcessGroup], dist.Work]


class _Group(dist.ProcessGroup):
    """The exchanges the engine makes, each reduced to ``_exchange(op, outputs, sent, start)``: ``start`` issues the
    real operation on a gloo group (recording) and is not called when replaying."""

    def __init__(self, rank: int, size: int, log: list[Exchange], index: int) -> None:
        super().__init__(rank, size)
        self._log, self._index = log, index

    def _exchange(self, op: str, outputs: list[torch.Tensor], sent: list[torch.Tensor], start: Start) -> dist.Work:
        raise NotImplementedError

    def allreduce(self, tensors, opts=AllreduceOptions()):
        return self._exchange("all_reduce", tensors, tensors, lambda g: g.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self._exchange("all_reduce_coalesced", tensors, tensors,
                              lambda g: g.allreduce_coalesced(tensors, opts))

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        outputs = [t for ts in output_lists for t in ts]
        return self._exchange("all_gather_list", outputs, inputs, lambda g: g.allgather(output_lists, inputs, opts))

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        return self._exchange("all_gather", [output], [input], lambda g: g._allgather_base(output, input, opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for output, input in zip(outputs, inputs, strict=True):
            work = self.all_gather_single(output, input, opts)
        return work

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        inputs = [t for ts in input_lists for t in ts]
        return self._exchange("reduce_scatter_list", outputs, inputs,
                              lambda g: g.reduce_scatter(outputs, input_lists, opts))

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        return self._exchange("reduce_scatter", [output], [input],
                              lambda g: g._reduce_scatter_base(output, input, opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        for output, input in zip(outputs, inputs, strict=True):
            work = self.reduce_scatter_single(output, input, opts)
        return work

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        return self._exchange("all_to_all", [output], [input],
                              lambda g: g.alltoall_base(output, input, output_splits, input_splits, opts))

    def broadcast(self, tensors, opts=BroadcastOptions()):
        # a receiving rank's buffer holds nothing it computed
        sent = tensors if self.rank() == opts.rootRank else []
        return self._exchange("broadcast", tensors, sent, lambda g: g.broadcast(tensors, opts))

    def barrier(self, opts=BarrierOptions()):
        return self._exchange("barrier", [], [], lambda g: g.barrier(opts))

    def send(self, tensors, dst: int, tag: int = 0):
        return self._exchange(f"send to {dst}", tensors, tensors, lambda g: g.send(tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return self._exchange(f"recv from {src}", tensors, [], lambda g: g.recv(tensors, src, tag))

    def getBackendName(self) -> str:
        return type(self).__name__

    @property
    def group_name(self) -> str:
        # torch names a Python group in its registry only, not on the group as it names its own
        return dist.distributed_c10d._world.pg_names[self]


class RecordingGroup(_Group):
    """A real gloo group whose every exchange is logged (see the module's docstring)."""

    def __init__(self, inner: dist.ProcessGroupGloo, rank: int, size: int, log: list[Exchange], index: int) -> None:
        super().__init__(rank, size, log, index)
        self._inner = inner

    def _exchange(self, op, outputs, sent, start):
        if _SESSION.paused:
            return start(self._inner)
        entry = Exchange(op, _metas(outputs), _copies(sent))  # before an in-place exchange overwrites them
        self._log.append(entry)  # its place is the order of the calls, whenever the program waits
        work = start(self._inner)
        if op.startswith("send"):  # left to the program to wait for, as its receives: see _RecordOnWait
            return work
        if op.startswith("recv"):
            return _RecordOnWait(work, outputs, entry)
        # the program waits before it reads the outputs, and every rank issues the collectives of a group in the
        # same order: waiting here changes no value and blocks no peer
        work.wait()
        entry.received = None if op == "barrier" else _copies(outputs)
        return work


class ReplayGroup(_Group):
    """A group of a world that is not there: each exchange writes the next logged entry into its outputs."""

    def __init__(self, rank: int, size: int, log: list[Exchange], index: int) -> None:
        super().__init__(rank, size, log, index)
        self.position = 0

    def _exchange(self, op, outputs, sent, start):
        position, self.position = self.position, self.position + 1
        where = f"group {self._index}, exchange {position}"
        if position >= len(self._log):
            raise ReplayMismatch(f"{where}: the program issues {op} {_metas(outputs)}, but the recorded rank's "
                                 f"exchanges of this group end at {len(self._log)}")
        entry = self._log[position]
        if (entry.op, entry.metas) != (op, _metas(outputs)):
            raise ReplayMismatch(f"{where}: the program issues {op} {_metas(outputs)} where the recorded rank "
                                 f"issued {entry.op} {entry.metas}")
        for mine, theirs in zip(sent, entry.sent, strict=True):
            if not torch.equal(mine, theirs):
                gap = (mine.double() - theirs.double()).abs().max().item()
                _SESSION.differences.append(f"{where} ({op}): contributed values differ by up to {gap:.3g}")
        with torch.no_grad():
            for output, value in zip(outputs, entry.received or []):
                output.copy_(value)
        return _Done()


def _create_recording(store, rank: int, size: int, timeout: timedelta) -> RecordingGroup:
    log: list[Exchange] = []
    _SESSION.logs.append(log)
    inner = dist.ProcessGroupGloo(store, rank, size, timeout)
    return RecordingGroup(inner, rank, size, log, len(_SESSION.logs) - 1)


def _create_replaying(store, rank: int, size: int, timeout: timedelta) -> ReplayGroup:
    index = len(_SESSION.replay_groups)
    if index >= len(_SESSION.logs):
        raise ReplayMismatch(f"the program creates group {index}; the recorded rank created {len(_SESSION.logs)}")
    group = ReplayGroup(rank, size, _SESSION.logs[index], index)
    _SESSION.replay_groups.append(group)
    return group


for _name, _creator in (("recording", _create_recording), ("replaying", _create_replaying)):
    if not hasattr(dist.Backend, _name.upper()):  # imported again under another name: the first one serves
        dist.Backend.register_backend(_name, _creator, devices=["cpu"])


def join_recording(rank: int, world: int, *, port: int) -> None:
    """This process as rank ``rank`` of a real gloo world of ``world`` processes, every exchange logged."""
    _SESSION.logs.clear()
    dist.init_process_group("recording", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def recorded_logs() -> list[list[Exchange]]:
    """This process's logs (after the program ran), one per group in creation order."""
    return list(_SESSION.logs)


def join_replay(logs: list[list[Exchange]], rank: int, world: int) -> None:
    """This process as rank ``rank`` of ``world``, every exchange answered from ``logs`` (that rank's recording)."""
    _SESSION.logs[:] = logs
    _SESSION.replay_groups.clear()
    _SESSION.differences.clear()
    dist.init_process_group("replaying", store=dist.HashStore(), rank=rank, world_size=world)


def differences() -> list[str]:
    """Where the last replay contributed other values than the recorded rank did."""
    return list(_SESSION.differences)


def unreplayed() -> dict[int, int]:
    """The groups of the last replay whose recording was not used up, and how many exchanges each has left: a
    program that stops short of the recorded one diverged from it as much as one that issues another exchange."""
    left = {index: len(group._log) - group.position for index, group in enumerate(_SESSION.replay_groups)}
    return {index: n for index, n in left.items() if n}
