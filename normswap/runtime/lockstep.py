"""Several loads of one checkpoint run unit by unit in turn, sharing each weight read.

The stock and RMSNorm forms of a converted checkpoint hold the same weights: only their norms
differ. Run one after the other, each would read every layer's weights from the checkpoint and
convert them to float32 again. Run in lockstep (``run_in_lockstep``), the models take turns a
unit at a time (the caller's list: a block, or one layer of a block): model 0 runs unit i, then
model 1 runs unit i, then model 0 runs unit i+1, and so on. Each weight is read and converted
once (``SharedReads``) by whichever model reaches it first, and handed to the other, so memory
holds one unit's weights at a time, as it does for one model.

Each model runs its own class's forward, unchanged, in its own thread; the turns make sure that
only one computes a unit at any moment, so the two never compete for the cores. Output heads
that all read the same weight (a vocabulary-wide matrix, often the largest tensor) make one pass
over it for every model (``SharedHead``) instead of a turn each.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.memory import BufferPool

T = TypeVar("T")


class SharedReads:
    """Tensors read once and handed to every reader that expects them.

    Each reader declares the sources it will read (``expect``); a source more than one read is
    expected of is kept from its first read until its last, then dropped."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self.expected: Counter[Hashable] = Counter()
        self.kept: dict[Hashable, list] = {}  # source -> [tensor, reads still to come]
        self.lock = threading.Lock()
        self.pool = pool  # when given, the float32 copies' memory, reused block after block

    def expect(self, sources: Iterable[Hashable]) -> None:
        self.expected.update(sources)

    def get(self, source: Hashable, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.lock:
            entry = self.kept.get(source)
            if entry is None:
                value = read()
                if self.expected[source] > 1:
                    self.kept[source] = [value, self.expected[source] - 1]
                return value
            entry[1] -= 1
            if entry[1] <= 0:
                del self.kept[source]
            return entry[0]

    def clear(self) -> None:
        with self.lock:
            self.kept.clear()


class SharedHead:
    """The output heads of several models of one lockstep run that read the same weight, computed
    in one pass over it (``pass_over``: inputs -> logits, each as a pass for that input alone
    computes them, so the figures are those of separate runs, bit for bit).

    Each member hands in its head's input and waits; the last to arrive computes every member's
    logits while the others wait, so no two models compute at once. A member whose run ends
    without handing anything in is no longer waited for (``leave``), and a failed run stops the
    waiting ones (``abort``). A member that runs its head again computes alone."""

    def __init__(self, members: Sequence[nn.Module],
                 pass_over: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        self.members, self.pass_over = {id(member) for member in members}, pass_over
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.settled: set[int] = set()  # members served, or gone without an input
        self.computing = self.aborted = False
        self.condition = threading.Condition()

    def logits(self, member: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        key = id(member)
        with self.condition:
            alone = key in self.settled
            if not alone:
                self.inputs[key] = hidden
                self.condition.notify_all()
                self.condition.wait_for(lambda: self.aborted or key in self.outputs or self._all_in())
                if self.aborted:
                    raise _Aborted
                if key in self.outputs:
                    return self._served(key)
                self.computing = True
        if alone:
            return self.pass_over([hidden])[0]
        try:
            names, inputs = zip(*self.inputs.items(), strict=True)
            computed = dict(zip(names, self.pass_over(list(inputs)), strict=True))
        except BaseException:
            self.abort()
            raise
        with self.condition:
            self.outputs.update(computed)
            self.inputs.clear()
            self.condition.notify_all()
            return self._served(key)

    def _all_in(self) -> bool:
        """Every member has handed its input in or is settled, and nobody computes yet."""
        return not self.computing and self.members <= self.inputs.keys() | self.settled

    def _served(self, key: int) -> torch.Tensor:
        self.settled.add(key)
        return self.outputs.pop(key)

    def leave(self, member: nn.Module) -> None:
        """``member``'s run has ended: if it handed nothing in, it never will."""
        with self.condition:
            self.settled.add(id(member))
            self.condition.notify_all()

    def abort(self) -> None:
        with self.condition:
            self.aborted = True
            self.condition.notify_all()


def shared_head(heads: Sequence[nn.Module | None], block_lists: Sequence[Sequence[nn.Module]]) -> SharedHead | None:
    """One ``SharedHead`` for the heads of every model of a lockstep run, or None. They share
    when they are distinct modules with one ``pass_key`` (``offload.HeadByVocabularyChunk``'s;
    None or absent: no sharing) and the turn lists are equally long; else each head keeps its
    turn. A head outside the pass would run beside it, and a model with more turns than another
    would wait on one parked at the pass."""
    keys = {getattr(head, "pass_key", None) for head in heads}
    if (len(heads) < 2 or None in keys or len(keys) > 1 or len({id(head) for head in heads}) < len(heads)
            or len({len(units) for units in block_lists}) > 1):
        return None
    return SharedHead(heads, heads[0].pass_over)


class _Aborted(Exception):
    """Another model of the lockstep failed: this one stops at its next block."""


class Turns:
    """Whose turn it is: model k may start its turn i once every model before it has finished
    i + 1 turns and every model after it i turns. Turns are counted as each model takes them, in
    the order its forward calls its units (a pre-norm block calls its norm first, whatever the
    order it declares its modules in). A model that has finished its run (or failed) no longer
    holds anyone up."""

    def __init__(self, count: int) -> None:
        self.done = [0] * count
        self.finished = [False] * count
        self.aborted = False
        self.condition = threading.Condition()

    def _may_start(self, model: int, turn: int) -> bool:
        return all(self.finished[other] or self.done[other] >= turn + (other < model)
                   for other in range(len(self.done)) if other != model)

    def enter(self, model: int) -> None:
        with self.condition:
            turn = self.done[model]
            self.condition.wait_for(lambda: self.aborted or self._may_start(model, turn))
            if self.aborted:
                raise _Aborted

    def leave(self, model: int) -> None:
        with self.condition:
            self.done[model] += 1
            self.condition.notify_all()

    def finish(self, model: int, failed: bool = False) -> None:
        with self.condition:
            self.finished[model] = True
            self.aborted = self.aborted or failed
            self.condition.notify_all()


@contextmanager
def _turn_hooks(turns: Turns, block_lists: list[Sequence[nn.Module]]) -> Iterator[None]:
    handles = []
    for model, units in enumerate(block_lists):
        for unit in units:
            handles.append(unit.register_forward_pre_hook(lambda module, args, model=model: turns.enter(model)))
            # a turn ends when the unit returns; hooks added later (per-block figures) may run past it
            handles.append(unit.register_forward_hook(lambda module, args, output, model=model: turns.leave(model)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_in_lockstep(runs: list[Callable[[], T]], block_lists: list[Sequence[nn.Module]],
                    heads: Sequence[nn.Module | None] = ()) -> list[T]:
    """``runs[k]()`` for every k, each in its own thread (the first in this one), taking turns
    block by block over ``block_lists[k]``; their results in order. The first failure is raised
    once every run has stopped. ``heads[k]``: model k's output head; when every model's head
    reads one weight, they make one pass over it (``shared_head``), which lets one model compute
    at a time as a turn would."""
    share = shared_head(heads, block_lists) if len(heads) == len(runs) else None
    if share is not None:  # a shared head is no turn of its own
        block_lists = [[unit for unit in units if unit is not heads[model]] for model, units in enumerate(block_lists)]
    turns = Turns(len(runs))
    results: list = [None] * len(runs)
    errors: list[BaseException | None] = [None] * len(runs)

    def run(model: int) -> None:
        try:
            results[model] = runs[model]()
        except BaseException as error:  # noqa: BLE001 (re-raised below, in the calling thread)
            errors[model] = error
            turns.finish(model, failed=True)
            if share is not None:
                share.abort()
        else:
            turns.finish(model)
        if share is not None:
            share.leave(heads[model])

    try:
        for head in heads if share is not None else ():
            head.shared = share
        with _turn_hooks(turns, block_lists):
            threads = [threading.Thread(target=run, args=(model,), daemon=True) for model in range(1, len(runs))]
            for thread in threads:
                thread.start()
            run(0)  # catches everything, so the other threads are always joined
            for thread in threads:
                thread.join()
    finally:
        for head in heads if share is not None else ():
            head.shared = None
    failures = [error for error in errors if error is not None and not isinstance(error, _Aborted)]
    if failures:
        raise failures[0]
    if any(errors):
        raise NormswapError("a lockstep run stopped without a reason")
    return results
