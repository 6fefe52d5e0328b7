"""Reading the same tensors again cheaply: the writer's cache of recent reads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RecentReads:
    """``read`` that remembers the last large tensor and a bounded set of small ones.

    Large means above ``small_bytes``; only one is kept, so the extra memory is at most one
    tensor of the group being written. Small tensors (norm gains and biases, read by every
    reader of a norm) are kept up to ``small_items``. Callers never modify what they get.
    """

    def __init__(self, read: Callable[[str], torch.Tensor], small_bytes: int = 1 << 20, small_items: int = 256) -> None:
        self._read = read
        self._small_bytes = small_bytes
        self._small_items = small_items
        self._small: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._large: tuple[str, torch.Tensor] | None = None
        self.disk_reads = 0

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._small:
            return self._small[name]
        if self._large is not None and self._large[0] == name:
            return self._large[1]
        self._large = None  # drop the previous large tensor before reading the next one
        value = self._read(name)
        self.disk_reads += 1
        if value.numel() * value.element_size() <= self._small_bytes:
            self._small[name] = value
            if len(self._small) > self._small_items:
                self._small.popitem(last=False)
        else:
            self._large = (name, value)
        return value
