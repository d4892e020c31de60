"""The engine loop's host work on the CPU, old tree against new in one call: the real loop, the device a stub.

The engine (q3tts/engine/engine.py and everything it calls: scheduler, sequences, KV blocks, readback, stream
hand-out) runs the tiny model on the CPU with its device work replaced at the model runner's and the codec
runner's frame step (`ModelRunner.step`, `CodecRunner.step`) and the talker's prefill forward
(`ModelRunner.talker`), the level that both trees share (measured first, with py-spy: with those three
replaced, no model code runs in the loop). The stub does what the frame does to the rows' flags (a row is done
after its `max_new_tokens`, codes are random, no EOS) and sleeps `--frame-ms` (the GPU's frame, waited for with
the interpreter's lock released; a spinning wait, as CUDA's default, gave the same ratios). Everything else is
the tree's own code, on one CPU thread for torch ops as the engine thread on a GPU. Its tensors are on the CPU:
a small op costs here about what a launch costs a GPU's host, a multi-tensor op costs one per tensor here and
one launch there; what a boundary runs is reported (`torch_ops`: kernels and views per iteration, and the
thread CPU time inside them, counted over a few iterations after the timed window). The frame's copies to the
host (`Readback.push`: DMA on a GPU, a 2 MB memcpy here at 256 rows) are reported and left out of
`host_ms_per_iteration` (`host_ms_with_readback_push` has them).

Load: `rows` requests in flight at every moment (closed loop: a stream that ends is replaced by a new request
at once), CustomVoice prompts, 75-175 frames each (the first `rows` spread over 5-175 so that departures are
steady from the start), the server's runaway guard, streams read by one event loop in the main thread (uvloop,
as uvicorn runs the server's routes; `--loop asyncio` for the standard one) with `stream.achunks()` as the
routes read them (each task counts its chunks, as a route would hand them to its encoder). Measured over
`--iterations` loop iterations after `--warmup`: the engine thread's CPU time per iteration (the stub's own
excluded) and per phase (its methods wrapped with timers: thread CPU time, not wall, so that the GIL's waits
and this shared machine's other processes count as little as possible), the event loop's CPU time per
delivered chunk (request submissions excluded, reported apart), the whole process's CPU per iteration (the
hand-out thread's included), and whether any stream fell behind real-time playback (a check: this machine's
neighbours stall it at times).

Each (tree, rows) is one child process; the trees alternate within each round of row counts, rounds repeat,
and the medians over rounds are reported. The base tree is a git worktree of `--base` made here.

usage: python bench/loop.py [--rows 64,128,256,512] [--rounds 3] [--frame-ms 5] [--base 5c33433]
       [--out bench/results/<date>-loop-cpu.json]
       python bench/loop.py --child --rows 256 [--extra runner.add_rows,...] [--cprofile out.prof]  (one tree:
       the one on PYTHONPATH)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_COMMIT = "5c33433"
# Engine methods and module functions timed as phases, where the tree has them (label: (owner kind, name)).
ENGINE_PHASES = ("_grow", "_launch", "_settle", "_drop_abandoned", "_audio", "_hand_out", "_join", "_start_codec")
FRAME = 0.08


# ---- the child: one tree, one row count -------------------------------------------------------------------

def _switches(native_id: int) -> int:
    """A thread's context switches so far (voluntary and not: each wait for the interpreter's lock is one)."""
    with open(f"/proc/self/task/{native_id}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


class Clock:
    """CPU time of one thread, readable from any thread."""

    def __init__(self, ident: int | None = None):
        self.clock = time.pthread_getcpuclockid(ident or threading.get_ident())

    def __call__(self) -> int:
        return time.clock_gettime_ns(self.clock)


class OpCounter:
    """Counts the torch operations run meanwhile (in the thread that entered it): views apart from those that run
    a kernel (on a GPU, a launch each: a multi-tensor one counts once)."""

    ITERATIONS = 30
    VIEWS = {"select", "slice", "view", "unbind", "alias", "as_strided", "_reshape_alias", "t", "transpose",
             "expand", "detach", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "unflatten",
             "reshape", "_unsafe_view", "lift_fresh", "empty", "empty_strided", "_to_copy", "to", "numpy", "clone"}

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.views = self.kernels = self.view_ns = self.kernel_ns = 0
                self.names: dict[str, int] = {}
                self.paused_depth = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if self.paused_depth:
                    return func(*args, **(kwargs or {}))
                name = func.__name__.split(".")[0]
                t = time.thread_time_ns()
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    spent = time.thread_time_ns() - t
                    if name in OpCounter.VIEWS:
                        self.views += 1
                        name = "view:" + name
                        self.view_ns += spent
                    else:
                        self.kernels += 1
                        self.kernel_ns += spent
                    self.names[name] = self.names.get(name, 0) + 1

            def paused(self):
                import contextlib

                @contextlib.contextmanager
                def pause():
                    self.paused_depth += 1
                    try:
                        yield
                    finally:
                        self.paused_depth -= 1
                return pause()

        return Mode()


class Probe:
    """The engine's phases timed in the engine thread (thread CPU time), and the stub that replaces the device."""

    def __init__(self, engine, frame_s: float, warmup: int, iterations: int, extra: tuple[str, ...] = (),
                 cprofile: str | None = None):
        import q3tts.engine.engine as engine_module

        Readback = engine_module.Readback  # (engine/readback.py before the packages by stage, runner/readback.py since)

        self.engine, self.frame_s, self.cprofile = engine, frame_s, cprofile
        self.warmup, self.iterations = warmup, iterations
        self.totals: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.stub_ns = 0
        self.iteration, self.rows = 0, 0
        self.marks: list[dict] = []
        self.done = threading.Event()
        self.engine_clock: Clock | None = None
        self.ops: OpCounter | None = None
        self.consumer_clock = Clock()  # (built in the main thread: the event loop's)
        self.counters = {"chunks": 0, "frames": 0, "submit_ns": 0, "requests": 0, "behind": 0, "ended": 0}
        targets = [(engine, name, name) for name in ENGINE_PHASES if hasattr(engine, name)]
        targets += [(engine.scheduler, "admit", "admit")]
        targets += [(engine_module, name, name) for name in ("deliver", "post") if hasattr(engine_module, name)]
        targets += [(Readback, name, f"readback.{name}") for name in ("push", "pop", "pop_pcm")]
        for path in extra:  # e.g. runner.add_rows: an attribute path from the engine (nested in the phases above)
            *owner_path, name = path.split(".")
            owner = engine
            for part in owner_path:
                owner = getattr(owner, part)
            targets.append((owner, name, path))
        self.phases = [label for _, _, label in targets]
        for owner, name, label in targets:
            setattr(owner, name, self._timed(label, getattr(owner, name)))
        self._stub_device(engine)

    def _timed(self, label: str, fn):
        totals, calls = self.totals, self.calls
        totals[label], calls[label] = 0, 0

        def timed(*args, **kwargs):
            t = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.thread_time_ns() - t
                calls[label] += 1
        return timed

    def _stub_device(self, engine) -> None:
        from contextlib import nullcontext

        def outside_counter():  # (the stub's own operations are the device's)
            return self.ops.paused() if self.ops is not None else nullcontext()

        import torch

        runner, codec = engine.runner, engine.codec
        generator = torch.Generator().manual_seed(0)
        hidden = runner.model.talker.config.hidden_size

        def step(num_rows: int) -> None:  # what the frame does to the rows' flags (no EOS), then its time
            t = time.thread_time_ns()
            self._mark(num_rows)
            with outside_counter():
                device_step(num_rows)
            self.stub_ns += time.thread_time_ns() - t
            time.sleep(self.frame_s)

        def device_step(num_rows: int) -> None:
            s, B = runner.state, num_rows
            finished = s.steps[:B] + 1 >= s.max_new[:B]
            s.emitted[:B] = ~s.done[:B] & ~finished
            s.done[:B] |= finished
            s.codes[:B] = torch.randint(0, 2048, (B, 16), generator=generator)
            s.positions[:B] += (~s.done[:B]).int()
            s.steps[:B] += 1

        def prefill(x, rows, positions, cache, **kwargs):  # the talker's prefill forward (its graph's replay)
            t = time.thread_time_ns()
            with outside_counter():
                out = torch.zeros(x.shape[0], hidden, dtype=x.dtype)
            self.stub_ns += time.thread_time_ns() - t
            return out

        runner.step = step
        runner.talker = prefill
        codec.step = lambda num_rows: None  # its PCM buffer stays zeros; the readback copies it as on a GPU

    def _mark(self, num_rows: int) -> None:
        """At each launch (engine thread): the window's marks."""
        if self.engine_clock is None:
            self.engine_clock = Clock()
        self.iteration += 1
        first = self.warmup
        if first < self.iteration <= first + self.iterations:
            self.rows += num_rows
        if self.iteration in (first, first + self.iterations):
            self.marks.append({"engine_switches": _switches(threading.get_native_id()),
                               "engine_ns": self.engine_clock(), "consumer_ns": self.consumer_clock(),
                               "process_ns": time.process_time_ns(), "wall_ns": time.perf_counter_ns(),
                               "stub_ns": self.stub_ns, "totals": dict(self.totals), "calls": dict(self.calls),
                               "counters": dict(self.counters)})
        if self.cprofile and self.iteration in (first, first + self.iterations):  # (in thread CPU time)
            import cProfile

            if self.iteration == first:
                self.profile = cProfile.Profile(time.thread_time_ns, 1e-9)
                self.profile.enable()
            else:
                self.profile.disable()
                self.profile.dump_stats(self.cprofile)
        # then, untimed, the torch operations of a few iterations (what a GPU's host pays per launch)
        if self.iteration == first + self.iterations:
            self.ops = OpCounter()
            self.ops.__enter__()
        if self.iteration == first + self.iterations + OpCounter.ITERATIONS:
            self.ops.__exit__(None, None, None)
            self.done.set()

    def result(self) -> dict:
        a, b = self.marks
        n = self.iterations
        rows = self.rows / n
        engine_ms = (b["engine_ns"] - a["engine_ns"] - (b["stub_ns"] - a["stub_ns"])) / 1e6 / n
        # the frame's copies to the host (Readback.push): DMA on a GPU (the host issues ~6 calls), memcpy here
        push_ms = (b["totals"]["readback.push"] - a["totals"]["readback.push"]) / 1e6 / n
        counters = {k: b["counters"][k] - a["counters"][k] for k in a["counters"]}
        chunks = max(counters["chunks"], 1)
        consumer_ns = b["consumer_ns"] - a["consumer_ns"] - counters["submit_ns"]
        phases = {}
        for label in self.phases:
            ms = (b["totals"][label] - a["totals"][label]) / 1e6 / n
            if label == "_launch":
                ms -= (b["stub_ns"] - a["stub_ns"]) / 1e6 / n  # (the stub runs inside it)
            phases[label] = {"ms_per_iteration": round(ms, 4), "us_per_row": round(ms * 1e3 / rows, 3),
                             "calls_per_iteration": round((b["calls"][label] - a["calls"][label]) / n, 2)}
        wall_ms = (b["wall_ns"] - a["wall_ns"]) / 1e6 / n
        ops = {"kernels_per_iteration": round(self.ops.kernels / OpCounter.ITERATIONS, 1),
               "views_per_iteration": round(self.ops.views / OpCounter.ITERATIONS, 1),
               # thread CPU time inside the operations (their C++ side: on the CPU the kernels run there)
               "kernel_ms_per_iteration": round(self.ops.kernel_ns / 1e6 / OpCounter.ITERATIONS, 4),
               "view_ms_per_iteration": round(self.ops.view_ns / 1e6 / OpCounter.ITERATIONS, 4),
               "ops_by_name": {k: round(v / OpCounter.ITERATIONS, 2)
                               for k, v in sorted(self.ops.names.items(), key=lambda kv: -kv[1])}}
        switches = (b["engine_switches"] - a["engine_switches"]) / n
        return {"rows": rows, "iterations": n, "host_ms_per_iteration": round(engine_ms - push_ms, 4),
                "host_us_per_row": round((engine_ms - push_ms) * 1e3 / rows, 3),
                "host_ms_with_readback_push": round(engine_ms, 4),
                "consumer_us_per_chunk": round(consumer_ns / 1e3 / chunks, 3),
                "consumer_us_per_frame": round(consumer_ns / 1e3 / max(counters["frames"], 1), 3),
                "consumer_ms_per_iteration": round(consumer_ns / 1e6 / n, 4),
                "submit_us_per_request": round(counters["submit_ns"] / 1e3 / max(counters["requests"], 1), 2),
                "process_cpu_ms_per_iteration": round((b["process_ns"] - a["process_ns"]
                                                       - (b["stub_ns"] - a["stub_ns"])) / 1e6 / n, 4),
                "wall_ms_per_iteration": round(wall_ms, 4), "frame_ms": self.frame_s * 1e3,
                "engine_context_switches_per_iteration": round(switches, 1),
                "chunks_per_iteration": round(counters["chunks"] / n, 2),
                "frames_per_iteration": round(counters["frames"] / n, 2),
                "requests_per_iteration": round(counters["requests"] / n, 3),
                "streams_ended": counters["ended"], "streams_behind_realtime": counters["behind"],  # (ever late)
                "torch_ops": ops, "phases": phases}


async def drive(tts, engine, probe: Probe, target: int, seed: int) -> None:
    """`target` streams in flight until the probe's window is over, each read with `achunks()`."""
    import dataclasses

    from q3tts import RunawayGuard

    rng = random.Random(seed)
    texts = ["Hello world, this is a test of speech synthesis.", "The quick brown fox jumps over a lazy dog.",
             "Seven bright stars shine above quiet hills and rivers.", "Please speak clearly, slowly and warmly."]
    speakers = ["ryan", "eric", "serena", "vivian", "aiden", "dylan"]
    guard = RunawayGuard()  # the server's default
    pool = []
    for i in range(24):
        request = tts.request(texts[i % len(texts)], speaker=speakers[i % len(speakers)], language="english",
                              seed=i, max_new_tokens=200)
        pool.append((tts.prepare(request), request.params, guard.frame_limit(request.text_tokens)))
    c, stop = probe.counters, asyncio.Event()

    async def reader(first: bool) -> None:
        while not probe.done.is_set():
            prompt, params, limit = rng.choice(pool)
            frames = rng.randint(5 if first else 75, 175)
            first = False
            t = time.thread_time_ns()
            stream = engine.submit(prompt, dataclasses.replace(params, max_new_tokens=frames + 1,
                                                               seed=rng.randrange(1 << 30)),
                                   asyncio_loop=True, stop_after=limit, stop_on_repeats=guard.repeated_frames)
            c["submit_ns"] += time.thread_time_ns() - t
            c["requests"] += 1
            start, got, behind = None, 0, False
            async for chunk in stream.achunks():
                now = time.perf_counter()
                start = start or now
                behind |= now > start + got * FRAME + 0.001  # frame `got` (the chunk's first) is late for playback
                got += chunk.shape[0] // 1920
                c["chunks"] += 1
                c["frames"] += chunk.shape[0] // 1920
            c["ended"] += 1
            c["behind"] += behind

    tasks = [asyncio.create_task(reader(True)) for _ in range(target)]
    while not probe.done.is_set():
        await asyncio.sleep(0.05)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # as the engine thread on a GPU (one_cpu_thread_on_gpu)
    import q3tts
    from q3tts import TTS, EngineConfig
    from q3tts.tiny import tiny_checkpoint

    args.rows = int(args.rows)
    config = EngineConfig(max_rows=args.rows, max_waiting=4096)
    tts = TTS.from_pretrained(tiny_checkpoint("tiny"), device="cpu", engine_config=config)
    engine = tts.engine
    probe = Probe(engine, args.frame_ms / 1e3, args.warmup, args.iterations,
                  tuple(filter(None, args.extra.split(","))), args.cprofile)
    gc.collect()
    gc.freeze()  # as `q3tts serve` does after start-up (server/service.py)
    if args.loop == "uvloop":  # what uvicorn runs the server's routes on when it is installed (the server extra)
        import uvloop

        uvloop.run(drive(tts, engine, probe, args.rows, seed=args.rows))
    else:
        asyncio.run(drive(tts, engine, probe, args.rows, seed=args.rows))
    result = probe.result()
    tts.close()
    print(json.dumps({"q3tts": str(Path(q3tts.__file__).parent.parent), **result}), flush=True)


# ---- the parent: both trees, interleaved rounds ----------------------------------------------------------

def base_tree(commit: str, path: Path) -> Path:
    """A worktree of `commit` at `path` (made once; reused when it already holds that commit)."""
    want = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], capture_output=True, text=True,
                          check=True).stdout.strip()
    if path.exists():
        have = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        if have.returncode == 0 and have.stdout.strip() == want:
            return path
        raise SystemExit(f"{path} exists and is not a worktree of {commit}: remove it or pass --base-dir")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), want], check=True,
                   capture_output=True)
    return path


def run_child(tree: Path, rows: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--rows", str(rows), "--frame-ms",
           str(args.frame_ms), "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--loop",
           args.loop]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} at {rows} rows failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(result.pop("q3tts")).resolve() != tree.resolve():
        raise RuntimeError(f"the child imported q3tts from elsewhere than {tree}")
    return result


def median_row(runs: list[dict]) -> dict:
    """The median over rounds of every number (phases included); the rounds' host times kept too."""
    def med(values):
        return round(statistics.median(values), 4)

    out = {k: med([r[k] for r in runs]) for k, v in runs[0].items() if isinstance(v, (int, float))}
    out["phases"] = {label: {k: med([r["phases"][label][k] for r in runs]) for k in runs[0]["phases"][label]}
                     for label in runs[0]["phases"]}
    ops = [r["torch_ops"] for r in runs]
    out["torch_ops"] = {k: med([o[k] for o in ops]) for k in ops[0] if k != "ops_by_name"}
    out["torch_ops"]["ops_by_name"] = ops[len(ops) // 2]["ops_by_name"]  # (one round's)
    out["rounds_host_ms_per_iteration"] = [r["host_ms_per_iteration"] for r in runs]
    out["rounds_consumer_us_per_chunk"] = [r["consumer_us_per_chunk"] for r in runs]
    return out


def commit_of(tree: Path) -> str:
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def parent(args: argparse.Namespace) -> None:
    rows = [int(r) for r in str(args.rows).split(",")]
    trees = {"before": base_tree(args.base, args.base_dir), "after": REPO}
    commits = {name: commit_of(tree) for name, tree in trees.items()}
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for n in rows:
            order = ("before", "after") if (r + rows.index(n)) % 2 == 0 else ("after", "before")
            for name in order:
                result = run_child(trees[name], n, args)
                runs.setdefault((name, n), []).append(result)
                print(f"round {r + 1} {name:6} {n:4} rows: host {result['host_ms_per_iteration']:7.3f} ms/iter "
                      f"({result['host_us_per_row']:6.2f} us/row), consumer {result['consumer_us_per_chunk']:6.2f} "
                      f"us/chunk, behind {result['streams_behind_realtime']}", flush=True)
    results = []
    for name in trees:
        for n in rows:
            row = median_row(runs[(name, n)])
            results.append({"engine": "q3tts", "benchmark": "loop", "tree": name, "commit": commits[name],
                            "model": "tiny (device stubbed)", "batch": n, "ms_per_frame": None,
                            "audio_s_per_s": None, "ttfa_ms_p50": None, "ttfa_ms_p95": None, "rps": None,
                            "behind_realtime_share": round(row["streams_behind_realtime"]
                                                           / max(row["streams_ended"], 1), 4), "gpu_mem_gb": None,
                            **row, "rows_target": n, "rows": row["rows"], "rounds": args.rounds})
    print_table(results)
    if args.out:
        write(results, args)


def print_table(results: list[dict]) -> None:
    labels = list(dict.fromkeys(label for r in results for label in r["phases"]))
    print(f"\n{'tree':6} {'rows':>5} {'host ms/it':>10} {'us/row':>7} {'cons us/chunk':>13}  "
          + " ".join(f"{label[-12:]:>12}" for label in labels))
    for r in results:
        print(f"{r['tree']:6} {r['rows']:5.0f} {r['host_ms_per_iteration']:10.3f} {r['host_us_per_row']:7.2f} "
              f"{r['consumer_us_per_chunk']:13.2f}  "
              + " ".join(f"{r['phases'][label]['ms_per_iteration']:12.3f}" if label in r["phases"] else f"{'-':>12}"
                         for label in labels))


def write(results: list[dict], args: argparse.Namespace) -> None:
    doc = {"card": f"CPU ({cpu_name()}, {os.cpu_count()} cores, no GPU)",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commits_line(results),
           "command": "python bench/loop.py " + " ".join(sys.argv[1:]), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def commits_line(results: list[dict]) -> str:
    return " vs ".join(dict.fromkeys(r["commit"] for r in results))


def default_loop() -> str:
    import importlib.util

    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,128,256,512", help="running rows, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frame-ms", type=float, default=5.0, help="the stubbed device's frame (default 5 ms)")
    parser.add_argument("--warmup", type=int, default=150, help="iterations before the window")
    parser.add_argument("--iterations", type=int, default=300, help="iterations measured")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default=default_loop(),
                        help="the consumers' event loop (default: uvloop where installed, as uvicorn runs the server)")
    parser.add_argument("--base", default=BASE_COMMIT, help="the tree before (a commit)")
    parser.add_argument("--base-dir", type=Path, default=Path("/tmp/loop-base"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--extra", default="", help="more phases to time, nested in those above: attribute paths from "
                        "the engine, e.g. runner.add_rows,codec.start (with --child)")
    parser.add_argument("--cprofile", help="with --child: write the engine thread's profile over the window here "
                        "(cProfile, in thread CPU time)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
