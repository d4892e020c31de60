"""The server builds prompts in batches (server/service.py, PromptBatcher): requests that arrive while a batch is
being built go together into the next one; a lone request is built at once; a bad request fails alone."""

from __future__ import annotations

import asyncio

import pytest

from q3tts.errors import RequestError
from q3tts.server.service import PromptBatcher


class FakeBuilder:
    """prepare_many stand-in: records each batch, holds it until released, fails any batch holding "bad"."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()

    async def __call__(self, requests):
        self.batches.append(list(requests))
        await self.release.wait()
        if "bad" in requests:
            raise RequestError("bad request")
        return [f"prompt of {r}" for r in requests]


def test_a_burst_is_built_in_batches():
    async def main():
        builder = FakeBuilder()
        batcher = PromptBatcher(builder)
        first = asyncio.create_task(batcher.build(["a"]))
        await asyncio.sleep(0)  # "a" is being built
        rest = [asyncio.create_task(batcher.build([r])) for r in ("b", "c")]
        pieces = asyncio.create_task(batcher.build(["d1", "d2"]))  # a long text's pieces
        await asyncio.sleep(0)
        builder.release.set()
        results = [await first] + [await t for t in rest] + [await pieces]
        assert results == [["prompt of a"], ["prompt of b"], ["prompt of c"], ["prompt of d1", "prompt of d2"]]
        assert builder.batches == [["a"], ["b", "c", "d1", "d2"]]
        assert await batcher.build(["e"]) == ["prompt of e"]  # alone again: at once
        assert builder.batches[-1] == ["e"]

    asyncio.run(main())


def test_a_bad_request_fails_alone_and_a_caller_that_left_is_skipped():
    async def main():
        builder = FakeBuilder()
        batcher = PromptBatcher(builder)
        first = asyncio.create_task(batcher.build(["a"]))
        await asyncio.sleep(0)
        good = asyncio.create_task(batcher.build(["b"]))
        bad = asyncio.create_task(batcher.build(["bad"]))
        gone = asyncio.create_task(batcher.build(["c"]))
        await asyncio.sleep(0)
        gone.cancel()
        builder.release.set()
        assert await first == ["prompt of a"] and await good == ["prompt of b"]
        with pytest.raises(RequestError, match="bad request"):
            await bad
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert builder.batches[1] == ["b", "bad", "c"] and ["b"] in builder.batches[2:]
        assert await batcher.build(["d"]) == ["prompt of d"]  # still serving

    asyncio.run(main())
