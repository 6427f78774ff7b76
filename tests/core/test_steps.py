"""core.steps: work written as steps runs to its end at once."""

from __future__ import annotations

from collections.abc import Generator

from compactd.core.steps import run_to_end


def _counted(seen: list[int], n: int) -> Generator[None, None, int]:
    for index in range(n):
        seen.append(index)
        yield
    return n * 10


def test_steps_run_to_their_end_at_once_give_their_value() -> None:
    seen: list[int] = []
    assert run_to_end(_counted(seen, 3)) == 30
    assert seen == [0, 1, 2]
