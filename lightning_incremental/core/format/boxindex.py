"""An index of boxes for the ones that share an element with a query box, so that matching n
boxes against m others costs about ``(n + m) log n`` box tests plus the matches, not ``n * m``.

A static tree of bounding boxes: the boxes are split at the median of their starts along the
dim where those starts spread widest, down to leaves of a few boxes. For disjoint boxes (the
pieces of a tensor, the shards a reader wants) a query only descends the branches whose
bounding box meets it, about ``log n`` nodes per box it finds. Boxes are anything with
``offsets`` and ``sizes`` (a :class:`~lightning_incremental.core.format.pieces.Box`); this
module needs none of them, so :mod:`~lightning_incremental.core.format.pieces` can use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

_LEAF = 8  # boxes per leaf

Corner = tuple[int, ...]


def meets(lo_a: Corner, hi_a: Corner, lo_b: Corner, hi_b: Corner) -> bool:
    """Whether the boxes ``[lo_a, hi_a)`` and ``[lo_b, hi_b)`` share an element: the one box
    test an index does (tests count its calls to bound the work of a query)."""
    # max(a, b) < min(c, d) in every dim, spelled out: a plan of 4,096 ranks' pieces makes half
    # a million of these tests, and the generator with max and min cost four times this loop.
    for a, c, b, d in zip(lo_a, hi_a, lo_b, hi_b):
        if a >= c or b >= d or a >= d or b >= c:
            return False
    return True


def corners(box: Any) -> tuple[Corner, Corner]:
    """A box's first index and its stops, per dim."""
    offsets = tuple(box.offsets)
    return offsets, tuple(o + s for o, s in zip(offsets, box.sizes))


class BoxIndex:
    """The boxes of ``boxes`` (by their position in it) that meet a query box."""

    def __init__(self, boxes: Sequence[Any]) -> None:
        self._lo: list[Corner] = []
        self._hi: list[Corner] = []
        for box in boxes:
            lo, hi = corners(box)
            self._lo.append(lo)
            self._hi.append(hi)
        # nodes: bounding box, and either two children or the boxes of a leaf
        self._node_lo: list[Corner] = []
        self._node_hi: list[Corner] = []
        self._children: list[tuple[int, int] | None] = []
        self._items: list[list[int]] = []
        if boxes:
            self._build(list(range(len(boxes))))

    def __len__(self) -> int:
        return len(self._lo)

    def _build(self, items: list[int]) -> int:
        lows = [self._lo[i] for i in items]
        node = len(self._items)
        self._node_lo.append(tuple(map(min, zip(*lows))))
        self._node_hi.append(tuple(map(max, zip(*(self._hi[i] for i in items)))))
        self._children.append(None)
        self._items.append(items)
        spread = [max(starts) - min(starts) for starts in zip(*lows)]
        if len(items) <= _LEAF or not spread or max(spread) == 0:
            return node
        dim = spread.index(max(spread))
        items = sorted(items, key=lambda i: self._lo[i][dim])
        half = len(items) // 2
        self._items[node] = []
        left = self._build(items[:half])
        self._children[node] = (left, self._build(items[half:]))
        return node

    def _walk(self, box: Any) -> Iterator[int]:
        lo, hi = corners(box)
        stack = [0] if self._items else []
        while stack:
            node = stack.pop()
            if not meets(self._node_lo[node], self._node_hi[node], lo, hi):
                continue
            children = self._children[node]
            if children is not None:
                stack += children
                continue
            for i in self._items[node]:
                if meets(self._lo[i], self._hi[i], lo, hi):
                    yield i

    def meeting(self, box: Any) -> list[int]:
        """The positions of the boxes that share an element with ``box``, ascending."""
        return sorted(self._walk(box))

    def meets_any(self, box: Any, skip: int | None = None) -> bool:
        """Whether a box other than the one at ``skip`` shares an element with ``box``."""
        return any(i != skip for i in self._walk(box))
