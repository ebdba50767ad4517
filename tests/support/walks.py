"""Counting tests' tables: a dict type whose walks (iteration, keys, values, items) are counted,
for the tests that hold a step or a check to O(1) work whatever the table's size (issue 39)."""

from __future__ import annotations

from typing import Any


def walk_counting(base: type[dict[Any, Any]]) -> Any:
    """A subclass of ``base`` whose instances count in ``walks`` every walk over them."""

    class Counted(base):  # type: ignore[misc, valid-type]
        walks = 0

        def __iter__(self) -> Any:
            self.walks += 1
            return super().__iter__()

        def keys(self) -> Any:
            self.walks += 1
            return super().keys()

        def values(self) -> Any:
            self.walks += 1
            return super().values()

        def items(self) -> Any:
            self.walks += 1
            return super().items()

    return Counted
