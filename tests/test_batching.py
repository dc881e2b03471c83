"""Group commit (core/batching.py), on its own: no store behind it."""

from __future__ import annotations

import asyncio

import pytest

from evolution_ingest.core.batching import Batcher


class RowError(Exception):
    """Stands for a statement failed by one of its rows."""


async def test_requests_of_one_loop_turn_ride_in_one_batch() -> None:
    batches: list[list[int]] = []

    async def execute(items: list[int]) -> list[int]:
        batches.append(items)
        return [item * 2 for item in items]

    batcher: Batcher[int, int] = Batcher(execute)
    results = await asyncio.gather(*(batcher(n) for n in range(10)))
    assert results == [n * 2 for n in range(10)]
    assert batches == [list(range(10))]


async def test_requests_arriving_while_a_batch_runs_wait_for_the_next_one() -> None:
    batches: list[list[int]] = []
    release = asyncio.Event()

    async def execute(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            await release.wait()
        return items

    batcher: Batcher[int, int] = Batcher(execute, max_concurrency=1)
    first = asyncio.ensure_future(batcher(0))
    await asyncio.sleep(0)  # wait-ok: one turn of the loop, so that the first batch is running
    later = [asyncio.ensure_future(batcher(n)) for n in range(1, 6)]
    await asyncio.sleep(0)  # wait-ok: one more turn: the later requests must not start a batch
    assert batches == [[0]]
    release.set()
    assert await asyncio.gather(first, *later) == list(range(6))
    assert batches == [[0], [1, 2, 3, 4, 5]]


async def test_a_failing_row_fails_alone_and_the_others_get_their_answers() -> None:
    async def execute(items: list[int]) -> list[int]:
        if 7 in items:
            raise RowError("row 7 is refused")
        return items

    batcher: Batcher[int, int] = Batcher(execute, isolate=lambda exc: isinstance(exc, RowError))
    results = await asyncio.gather(*(batcher(n) for n in range(12)), return_exceptions=True)
    assert [r for r in results if isinstance(r, RowError)] == [results[7]]
    assert [r for n, r in enumerate(results) if n != 7] == [n for n in range(12) if n != 7]
    assert batcher.splits > 0


async def test_a_repeated_key_waits_for_the_next_batch() -> None:
    batches: list[list[str]] = []

    async def execute(items: list[str]) -> list[str]:
        batches.append(items)
        return items

    batcher: Batcher[str, str] = Batcher(execute, key=lambda item: item)
    await asyncio.gather(batcher("a"), batcher("b"), batcher("a"))
    assert batches == [["a", "b"], ["a"]]


async def test_a_batch_cancelled_before_it_ran_leaves_the_batcher_working() -> None:
    async def execute(items: list[int]) -> list[int]:
        return items

    batcher: Batcher[int, int] = Batcher(execute, max_concurrency=1)
    waiting = batcher.submit(1)
    for task in list(batcher._tasks):  # cancelled before its first step, as at a shutdown
        task.cancel()
    assert await asyncio.wait_for(waiting, 2) == 1, "the request was taken by another batch"
    assert await asyncio.wait_for(batcher(2), 2) == 2


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_every_request_is_answered_under_concurrency(concurrency: int) -> None:
    async def execute(items: list[int]) -> list[int]:
        await asyncio.sleep(0)  # wait-ok: a round trip's worth of a loop turn
        return items

    batcher: Batcher[int, int] = Batcher(execute, max_size=16, max_concurrency=concurrency)

    async def client(start: int) -> list[int]:
        return [await batcher(n) for n in range(start, start + 50)]

    answers = await asyncio.gather(*(client(100 * c) for c in range(20)))
    assert answers == [list(range(100 * c, 100 * c + 50)) for c in range(20)]
    assert batcher.items == 1000
    assert batcher.items / batcher.batches > 2, "requests were not grouped"


async def test_a_lingering_batch_takes_what_is_submitted_during_its_linger() -> None:
    batches: list[list[int]] = []

    async def execute(items: list[int]) -> list[int]:
        batches.append(items)
        return items

    batcher: Batcher[int, int] = Batcher(execute, max_concurrency=1, linger=0.05)
    first = batcher.submit(0)
    await asyncio.sleep(0)  # wait-ok: turns of the loop pass within the linger, each submitting more
    second = batcher.submit(1)
    await asyncio.sleep(0)  # wait-ok: as above
    third = batcher.submit(2)
    assert batches == []  # nothing ran yet: the batch is still gathering
    assert await asyncio.gather(first, second, third) == [0, 1, 2]
    assert batches == [[0, 1, 2]]


async def test_a_lingering_batch_that_is_already_full_runs_at_once() -> None:
    ran = asyncio.Event()

    async def execute(items: list[int]) -> list[int]:
        ran.set()
        return items

    batcher: Batcher[int, int] = Batcher(execute, max_size=3, linger=60)
    results = [batcher.submit(n) for n in range(3)]
    await asyncio.wait_for(ran.wait(), 5)  # a linger of a minute would time this out
    assert await asyncio.gather(*results) == [0, 1, 2]
