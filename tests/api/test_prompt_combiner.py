"""Prompts asked for by many threads at once are built in batches (api/engine_host.py, PromptCombiner): a request
that arrives while a batch is being built goes into the next one, built by the first thread waiting; a lone request
is built at once in its own thread; a bad request fails alone; a waiting thread that is interrupted passes its turn
on. Then the same on a model: live requests started from many threads give the codes each gives alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from q3tts.api import engine_host
from q3tts.api.engine_host import PromptCombiner
from q3tts.errors import RequestError


class FakeBuilder:
    """prepare_many stand-in: records each batch and the thread that built it, holds the first batch until
    released, fails any batch holding "bad"."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.builders: list[str] = []
        self.release = threading.Event()

    def __call__(self, requests):
        self.batches.append(list(requests))
        self.builders.append(threading.current_thread().name)
        if len(self.batches) == 1:
            assert self.release.wait(10)
        if "bad" in requests:
            raise RequestError("bad request")
        return [f"prompt of {r}" for r in requests]


def waiting(combiner: PromptCombiner, n: int) -> None:
    deadline = time.monotonic() + 10
    while combiner.num_waiting < n:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def outcome(combiner: PromptCombiner, request: str):
    try:
        return combiner.build(request)
    except RequestError as e:
        return e


def test_requests_from_many_threads_are_built_in_batches():
    builder = FakeBuilder()
    combiner = PromptCombiner(builder)
    with ThreadPoolExecutor(8, thread_name_prefix="caller") as pool:
        first = pool.submit(combiner.build, "a")
        while not builder.batches:
            time.sleep(0.002)
        rest = {r: pool.submit(outcome, combiner, r) for r in ("b", "c", "bad", "d")}
        waiting(combiner, 4)
        builder.release.set()
        assert first.result() == "prompt of a"
        results = {r: f.result() for r, f in rest.items()}
    assert {r: results[r] for r in "bcd"} == {r: f"prompt of {r}" for r in "bcd"}
    assert isinstance(results["bad"], RequestError) and "bad request" in str(results["bad"])
    assert builder.batches[:2] == [["a"], ["b", "c", "bad", "d"]]  # then one at a time: the bad one fails alone
    assert sorted(map(tuple, builder.batches[2:])) == [("b",), ("bad",), ("c",), ("d",)]
    assert len(set(builder.builders[1:])) == 1  # the second batch's requests, built by one of their threads
    assert combiner.build("e") == "prompt of e" and builder.batches[-1] == ["e"]  # alone again: at once


def test_an_interrupted_waiter_passes_its_turn_on(monkeypatch):
    """The thread woken to build the next batch is gone (Ctrl-C while it waited): the next one builds it."""
    builder = FakeBuilder()
    combiner = PromptCombiner(builder)

    class Interrupted(threading.Event):
        def wait(self, timeout=None):
            super().wait(timeout)  # (woken to build the next batch, then interrupted)
            raise KeyboardInterrupt

    made = []

    class Wanted(engine_host.WantedPrompt):
        def __init__(self, request):
            super().__init__(request)
            if request == "gone":
                self.ready = Interrupted()
            made.append(request)

    monkeypatch.setattr(engine_host, "WantedPrompt", Wanted)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(combiner.build, "a")
        while not builder.batches:
            time.sleep(0.002)
        gone = pool.submit(combiner.build, "gone")
        waiting(combiner, 1)
        after = pool.submit(combiner.build, "b")
        waiting(combiner, 2)
        builder.release.set()
        assert first.result() == "prompt of a" and after.result(10) == "prompt of b"
        with pytest.raises(KeyboardInterrupt):
            gone.result()
    assert ["gone"] not in builder.batches and builder.batches[1] == ["b"]
