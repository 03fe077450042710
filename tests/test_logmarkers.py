"""Log marker parsing: every fixture replayed on a simulated clock, and the rules one by one."""

from __future__ import annotations

import io
import itertools
import random
import time
from datetime import datetime

import pytest
from helpers.logreplay import FIXTURES, Replay, replay, replay_fixture, replay_journal

from exporter.config.reader import parse_config
from exporter.load.events import EventKind
from exporter.load.steps import StepTimeline, tighten
from exporter.logs.markers import DETAIL_MAX, DETECT_ANNOUNCE_LINES, MarkerParser, as_lines, detect
from exporter.servers import SERVERS
from exporter.sim.serverlog import LOG_WRITERS, LogContext
from exporter.vocabulary import AUTO, ServerKind, Step

# (fixture, detected format, event kinds in order ("kind*n" = n in a row), seconds per step).
# Stamped logs take their durations from the stamps, made exact by the durations the end lines
# state where those agree within a stamp's second; llama.cpp's from 0.1 s per line.
FIXTURE_CASES = [
    ("sglang-0.5-tp2.log", "sglang", "weights_begin weights_progress*5 weights_end kv_cache cuda_graph_begin cuda_graph_progress*5 cuda_graph_end warmup_begin ready", {"weights": 20.85, "kv_cache": 0.5, "cuda_graph": 12.35, "warmup": 3.251}),
    ("sglang-0.4.log", "sglang", "weights_begin weights_progress*5 weights_end kv_cache cuda_graph_begin cuda_graph_progress*5 cuda_graph_end warmup_begin ready", {"weights": 5.0, "kv_cache": 1.0, "cuda_graph": 4.28, "warmup": 1.8}),
    # Real SGLang 0.5.23 on CPU (tests/servers/test_exporter_on_sglang.py): no CUDA graphs; the
    # warm-up step runs from uvicorn's start to "fired up" (the completions answered meanwhile);
    # the KV cache's step began its `kv_cache_allocation=0.56` before its line.
    ("sglang-0.5.23-cpu-cold.log", "sglang", "weights_begin weights_progress*4 weights_end kv_cache kv_cache_timed warmup_begin ready", {"weights": 13.64, "kv_cache": 1.56, "warmup": 3.0}),
    ("sglang-fatal.log", "sglang", "weights_begin weights_end fatal", {"weights": 8.0}),
    ("vllm-0.33-tp2.log", "vllm", "weights_begin weights_progress*5 weights_end compile_begin compile_end kv_cache cuda_graph_begin cuda_graph_progress*4 cuda_graph_end node_up ready", {"weights": 31.4, "compile": 16.0, "kv_cache": 0.1, "cuda_graph": 12.0}),
    ("vllm-0.9-tp2-ansi.log", "vllm", "weights_begin weights_progress*4 weights_end compile_begin compile_end kv_cache cuda_graph_begin cuda_graph_progress*4 cuda_graph_end node_up ready", {"weights": 26.02, "compile": 45.2, "kv_cache": 0.2, "cuda_graph": 13.0}),
    ("vllm-0.6.log", "vllm", "weights_begin weights_progress*5 weights_end kv_cache cuda_graph_begin cuda_graph_end node_up ready", {"weights": 7.0, "kv_cache": 2.0, "cuda_graph": 11.0}),
    ("vllm-fatal.log", "vllm", "weights_begin weights_end kv_cache fatal", {"weights": 24.8, "kv_cache": 0.6}),
    # Real vLLM 0.32 on CPU (bench/vllm_file_timeline.py): "Warming up model for the
    # compilation..." begins the compile, "Initial profiling/warmup run took" the dummy runs
    # until the KV cache (whole-second stamps, but "Loading weights took 1.28 seconds").
    ("vllm-0.32-cpu-cold.log", "vllm", "weights_begin weights_progress*5 weights_end compile_begin warmup_begin node_up kv_cache ready", {"weights": 12.04, "compile": 41.0, "warmup": 30.0, "kv_cache": 7.3}),
    ("vllm-0.32-cpu-warm.log", "vllm", "weights_begin weights_progress*3 weights_end compile_begin warmup_begin node_up kv_cache ready", {"weights": 1.28, "compile": 19.0, "warmup": 47.0, "kv_cache": 9.3}),
    # Real vLLM 0.32 on CPU at --tensor-parallel-size 2 (tests/servers/test_ranks_on_vllm.py):
    # both ranks say they begin, only Worker_TP0 that its weights took 12.94 s (vLLM's info_once
    # is the first rank's alone), so the warm-up line implies the end (the tracker dates it by
    # the file view). Then TP1 killed mid-weights: the executor says it shuts down at once.
    ("vllm-0.32-cpu-tp2-cold.log", "vllm", "weights_begin weights_progress*5 weights_end compile_begin warmup_begin node_up kv_cache ready", {"weights": 19.0, "compile": 29.0, "warmup": 71.0, "kv_cache": 6.3}),
    ("vllm-0.32-cpu-tp2-rank-killed.log", "vllm", "weights_begin weights_progress fatal", {"weights": 4.0}),
    # Real vLLM 0.32 on CPU over two hosts (TP 2, one rank per node, no Ray): the head serves;
    # node 1 runs `--headless`, and its log ends its start-up with its worker's KV cache line
    # (node_up; the head's worker writes it too, where it ends nothing), then, minutes later,
    # the shutdown. A step timeline knows no role: there the warm-up runs on to that shutdown,
    # while a follower's tracker ends its load at node_up (tests/test_followers.py).
    ("vllm-0.32-cpu-2nodes-head.log", "vllm", "weights_begin weights_progress*3 weights_end compile_begin warmup_begin node_up kv_cache ready", {"weights": 1.49, "compile": 19.0, "warmup": 34.0, "kv_cache": 4.3}),
    ("vllm-0.32-cpu-2nodes-follower.log", "vllm", "weights_begin weights_end compile_begin warmup_begin node_up fatal", {"weights": 1.41, "compile": 19.0, "warmup": 362.0}),
    # llama-server's weights begin at its `load_model: loading model` line, as it opens the GGUF.
    ("llamacpp-server.log", "llamacpp", "weights_begin weights_progress weights_end kv_cache warmup_begin ready", {"weights": 1.3, "kv_cache": 0.4, "warmup": 0.3}),
    ("llamacpp-fatal.log", "llamacpp", "weights_begin fatal", {"weights": 0.4}),
    ("llamacpp-python-0.3.36-real.log", "llamacpp", "weights_begin weights_progress weights_end kv_cache ready", {"weights": 27.2, "kv_cache": 28.7}),
    ("llamacpp-python-0.3.36-real-fail.log", "llamacpp", "fatal", {}),
    # Real llama-server (tests/servers/llama_server.py's build and model), at its default
    # verbosity: only its own lines, stamped with the time since its start (read at 0.1 s a
    # line here; test_llama_server_stamps_date_lines_from_the_process_start reads the stamps).
    ("llama-server-real.log", "llamacpp", "weights_begin weights_end ready", {"weights": 0.1}),
    ("llama-server-real-fail.log", "llamacpp", "weights_begin fatal", {"weights": 0.2}),
    # Real llama-server in router mode (`--models-dir`): `POST /models/load` starts a child whose
    # lines the router forwards with `[PORT] ` before them (the child's, not the router's: no
    # event of the router's), then `/models/unload` stops it: the router unloaded it.
    ("llama-server-0.3.36-router-real.log", "llamacpp", "unloaded", {}),
    ("tgi-3.3-sharded.log", "tgi", "weights_begin weights_end warmup_begin kv_cache cuda_graph_begin cuda_graph_end ready", {"weights": 17.99, "warmup": 0.8, "kv_cache": 0.01, "cuda_graph": 8.39}),
    ("tgi-fatal.log", "tgi", "weights_begin fatal", {"weights": 15.69}),
    ("triton-2.log", "triton", "load_begin weights_begin weights_end ready", {"weights": 40.6}),
    ("triton-fatal.log", "triton", "load_begin weights_begin fatal", {"weights": 4.0}),
    # Real tritonserver 2.51 (tests/servers/triton_server.py's model): quoted messages; the
    # weights from the instance's initialize() to `successfully loaded`. In explicit mode the
    # HTTP service starts first, a model loads later, on request (a load of its own: its
    # load_begin starts a new cycle), and is unloaded (no part of any load).
    ("triton-2.51-real.log", "triton", "load_begin weights_begin weights_end ready unloaded", {"weights": 0.351}),
    ("triton-2.51-real-explicit.log", "triton", "ready load_begin weights_begin weights_end unloaded", {"weights": 0.698}),
]  # fmt: skip

JOURNAL_CASES = [
    # The simulator under systemd-cat (2 s of init), read back with journalctl -o json: the
    # byte-array MESSAGEs of \r-redrawn bars, and whole-second stamps refined by journald's time.
    # Its KV line comes as the allocation begins (the real one's as it ends): the stated 0.30 s
    # moves the step back only to the weights' end, 2 ms before it.
    ("journald-sglang-sim.jsonl", "sglang", "weights_begin weights_progress*5 weights_end kv_cache compile_begin cuda_graph_begin cuda_graph_progress*10 cuda_graph_end kv_cache_timed warmup_begin ready", {"weights": 0.0, "kv_cache": 0.303, "compile": 1.052, "cuda_graph": 1.2, "warmup": 0.451}),
    # The real llama-cpp-python server in a unit's cgroup: no stamps, journald's time only.
    ("journald-llamacpp-python-0.3.36-real.jsonl", "llamacpp", "weights_begin weights_progress weights_end kv_cache ready", {"weights": 0.057, "kv_cache": 0.062}),
]  # fmt: skip


def compact(kinds: list[str]) -> str:
    parts = []
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        parts.append(kind if n == 1 else f"{kind}*{n}")
    return " ".join(parts)


def check(result: Replay, fmt: str, kinds: str, durations: dict[str, float]) -> None:
    assert result.parser.format == fmt
    assert compact(result.kinds) == kinds
    assert result.durations() == pytest.approx(durations, abs=1e-3)
    seqs = [e.seq for e in result.events]
    assert seqs == list(range(1, len(seqs) + 1))
    times = [e.time for e in result.events]
    assert times == sorted(times)
    assert result.timeline.step is Step.NONE  # every load here ended ready or fatal


@pytest.mark.parametrize(("name", "fmt", "kinds", "durations"), FIXTURE_CASES)
def test_fixture_events_and_step_durations(
    name: str, fmt: str, kinds: str, durations: dict[str, float]
) -> None:
    check(replay_fixture(name), fmt, kinds, durations)
    check(replay_fixture(name, fmt), fmt, kinds, durations)  # configured, not detected


@pytest.mark.parametrize(("name", "fmt", "kinds", "durations"), JOURNAL_CASES)
def test_journal_exports(name: str, fmt: str, kinds: str, durations: dict[str, float]) -> None:
    check(replay_journal(name), fmt, kinds, durations)


def test_every_fixture_is_in_a_table() -> None:
    named = {case[0] for case in FIXTURE_CASES + JOURNAL_CASES}
    on_disk = {p.name for p in FIXTURES.iterdir() if p.suffix in (".log", ".jsonl")}
    assert named == on_disk


def test_llama_server_stamps_date_lines_from_the_process_start() -> None:
    """Given the start of the process whose own log it is, a line stamped `M.SS.mmm.uuu` is at
    that start plus the stamp, however late it is read; without one, when it was read."""
    start = 1_780_000_000.0
    late = replay_fixture("llama-server-real.log", start=start + 600.0, origin=start)
    times = {e.kind.value: round(e.time - start, 6) for e in late.events}
    assert times == {"weights_begin": 0.00395, "weights_end": 0.280076, "ready": 2.107408}
    assert late.durations() == {"weights": 0.276}
    failed = replay_fixture("llama-server-real-fail.log", start=start + 5.0, origin=start)
    fatal = failed.first("fatal")
    assert round(fatal.time - start, 6) == 0.004423
    assert "failed to load model" in fatal.detail and "not within the file bounds" in fatal.detail
    # Read as it is written (each line a moment after its stamp): never later than its reading.
    live = replay_fixture("llama-server-real.log", start=start, origin=start, per_line=0.0001)
    assert all(e.time - start <= 0.0001 * 20 for e in live.events)
    unknown = replay_fixture("llama-server-real.log", start=start)  # no origin: read times
    assert unknown.durations() == {"weights": 0.1}


def test_one_models_events_from_a_server_loading_several() -> None:
    """Triton loading two models at once: read for one of them, the lines naming the other are
    none of its (read for the server, the two merge as if ranks of one load, 40.6 s of
    weights); lines naming no model (the HTTP service) are every model's."""
    start = datetime(2026, 3, 2, 10, 0).timestamp()
    onnx = replay_fixture("triton-2.log", model="densenet_onnx")
    llama = replay_fixture("triton-2.log", model="llama")
    both = replay_fixture("triton-2.log")
    assert (
        compact(onnx.kinds) == compact(llama.kinds) == "load_begin weights_begin weights_end ready"
    )
    assert [e.time - start for e in onnx.events] == pytest.approx([0.5, 1.1, 3.2, 41.801])
    assert [e.time - start for e in llama.events] == pytest.approx([0.51, 1.2, 41.7, 41.801])
    assert {e.who for e in onnx.events} == {"densenet_onnx", None}
    assert onnx.durations() == pytest.approx({"weights": 2.1})
    assert llama.durations() == pytest.approx({"weights": 40.5})
    assert both.durations() == pytest.approx({"weights": 40.6})
    # Another model failed to load: not this one's failure; the server then failing to start
    # (`error: creating server`) is every model's.
    other = replay_fixture("triton-fatal.log", model="other")
    assert [e.detail.split(":")[0] for e in other.events] == ["error"]
    own = replay_fixture("triton-fatal.log", model="llama")
    assert (
        own.events[-1].kind is EventKind.FATAL and "failed to load 'llama'" in own.events[-1].detail
    )


def test_a_model_servers_lines_in_its_routers_log() -> None:
    """llama-server's router forwards its model server's lines with `[PORT] ` before each,
    stamped with the time since the model server started: read for that server (its start as
    the origin), they are its load's events; the router's own lines are none of its, and read
    for the router, the forwarded ones are none of the router's."""
    start = 1_800_000_000.0
    model = replay_fixture(
        "llama-server-0.3.36-router-real.log", start=start + 60, origin=start, lines_of="[38321] "
    )
    assert compact(model.kinds) == "weights_begin weights_end ready"
    assert [e.time - start for e in model.events] == pytest.approx(
        [0.005314, 0.063005, 3.875273], abs=1e-6
    )
    other = replay_fixture("llama-server-0.3.36-router-real.log", origin=start, lines_of="[1234] ")
    assert other.kinds == [] and other.parser.format is None  # no line of its: nothing decided
    router = replay_fixture("llama-server-0.3.36-router-real.log", origin=start)
    assert compact(router.kinds) == "unloaded"


def test_tensor_parallel_ranks_merge_into_one_event_each() -> None:
    sglang = replay_fixture("sglang-0.5-tp2.log")
    end = sglang.first("weights_end")
    assert (end.rank, end.who, end.seconds) == (1, "TP1", 20.85)  # the last rank to finish
    assert sglang.first("cuda_graph_end").rank == 0  # TP0 finished capturing last
    assert sum(e.kind is EventKind.KV_CACHE for e in sglang.events) == 1
    old = replay_fixture("vllm-0.9-tp2-ansi.log")
    assert old.first("weights_begin").who == "VllmWorker rank=0"  # ANSI colour codes gone
    assert old.first("compile_end").rank == 1
    tgi = replay_fixture("tgi-3.3-sharded.log")
    assert (tgi.first("weights_end").who, tgi.first("weights_end").seconds) == ("rank=0", 17.989)


def test_progress_is_the_slowest_ranks() -> None:
    bar = (
        "(Worker_TP{} pid=1) Loading safetensors checkpoint shards: {:3d}% Completed | {}/4 [00:02]"
    )
    steps = [(0, 0), (1, 0), (0, 2), (1, 1), (0, 4), (1, 4)]  # (rank, shards done)
    lines = [bar.format(rank, 25 * done, done) for rank, done in steps]
    result = replay("\n".join(lines), "vllm")
    progress = [(e.done, e.rank) for e in result.events if e.kind is EventKind.WEIGHTS_PROGRESS]
    # TP0 running ahead moves nothing: the slowest rank (TP1) sets the pace; only changes fire.
    assert progress == [(0, 0), (1, 1), (4, 0)]
    assert result.kinds[0] == "weights_begin"  # a bar is the first sign of the span


def test_tqdm_redraws_in_one_chunk_and_an_open_bar() -> None:
    parser = MarkerParser("sglang")
    bar = "Loading safetensors checkpoint shards: {p:3d}% Completed | {k}/4 [00:01<00:01]"
    chunk = "[2026-03-02 10:00:00] Load weight begin. avail mem=70.00 GB\n" + "".join(
        "\r" + bar.format(p=25 * k, k=k) for k in range(3)
    )
    cut = chunk.rfind("\r")
    events = parser.feed(chunk[:cut], 100.0)
    assert [(e.kind.value, e.done) for e in events] == [
        ("weights_begin", None),
        ("weights_progress", 0),
        ("weights_progress", 1),
    ]
    # The last redraw has no terminator yet: `peek` sees its progress, and only once.
    assert [e.done for e in parser.peek(chunk[cut:], 101.0)] == [2]
    assert parser.peek(chunk[cut:], 101.5) == []
    assert parser.feed(chunk[cut:] + "\n", 102.0) == []


def test_llamacpp_dots_while_open_and_when_done() -> None:
    parser = MarkerParser("llamacpp")
    parser.feed("load_tensors: loading model tensors, this can take a while... (mmap = true)\n", 1)
    assert [(e.done, e.total) for e in parser.peek("." * 40, 2.0)] == [(40, 100)]
    assert [(e.done, e.total) for e in parser.peek("." * 120, 3.0)] == [(99, 100)]
    assert [(e.done, e.total) for e in parser.feed("." * 57 + "\n", 4.0)] == [(100, 100)]


def test_as_lines_strips_ansi_and_splits_carriage_returns() -> None:
    raw = "\x1b[1;36m(VllmWorker rank=0 pid=5)\x1b[0;0m a\r\nb\rc\x1b]0;title\x07d\n"
    assert as_lines(raw) == "(VllmWorker rank=0 pid=5) a\nb\ncd\n"


def test_detection_says_which_line_decided_and_replays_earlier_lines() -> None:
    parser = MarkerParser("auto")
    noise = "".join(f"pip noise {i}\n" for i in range(5))
    assert parser.feed(noise, 1.0) == []
    assert parser.format is None
    events = parser.feed("Load weight begin. avail mem=70.00 GB\n[2026-03-02 10:00:00] x\n", 2.0)
    assert parser.format == ServerKind.SGLANG
    assert "line 7 matched sglang" in parser.format_reason
    assert [e.kind for e in events] == [EventKind.WEIGHTS_BEGIN]  # seen before the decision


@pytest.mark.parametrize(
    ("line", "fmt"),
    [
        ("[2026-03-02 10:00:00.101 DP0 TP3] x", "sglang"),
        ("(EngineCore_DP0 pid=7) INFO 03-02 10:00:00 [core.py:77] x", "vllm"),
        ("(Worker_TP1 pid=7) Loading safetensors checkpoint shards:   0% Completed | 0/4", "vllm"),
        ("WARNING 08-06 12:00:00 llm_engine.py:213] x", "vllm"),
        ("llama_model_loader: loaded meta data with 33 key-value pairs", "llamacpp"),
        ("2026-03-02T10:00:00.123456Z  INFO text_generation_launcher: x", "tgi"),
        ("I0302 10:00:00.100000 1 server.cc:674] x", "triton"),
        ("INFO:     Application startup complete.", None),
        ("Traceback (most recent call last):", None),
    ],
)
def test_detect(line: str, fmt: str | None) -> None:
    assert detect(line) == fmt


def test_unknown_format_gives_no_events_and_says_so() -> None:
    parser = MarkerParser("auto")
    text = "".join(
        f"{i}: Load weight begin, KV Cache is allocated, Connected\n" for i in range(3000)
    )
    assert parser.feed(text, 1.0) == []
    assert parser.unknown_announced
    assert parser.format_reason == (
        "auto: unknown format, none of 3000 lines matched a known server; no events"
    )
    assert DETECT_ANNOUNCE_LINES < 3000


def test_garbage_binary_and_a_huge_line_do_not_crash() -> None:
    rng = random.Random(7)
    for fmt in [AUTO, *SERVERS]:
        parser = MarkerParser(fmt)
        for _ in range(50):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
            parser.feed(junk.decode("utf-8", "replace"), 1.0)
            parser.peek(junk.decode("latin-1"), 1.0)
        started = time.process_time()
        for event in parser.feed("Load weight begin. " + "x" * 10_000_000, 2.0):
            assert len(event.detail) <= DETAIL_MAX
        parser.feed("." * 10_000_000 + "\n", 2.0)
        assert time.process_time() - started < 5


def test_a_new_load_after_ready_starts_a_new_cycle() -> None:
    text = (FIXTURES / "sglang-0.4.log").read_text()
    result = replay(text + text.replace("2025-01-20 08:15", "2025-01-20 08:25"))
    assert result.kinds.count("weights_begin") == 2
    assert result.kinds.count("ready") == 2
    assert result.durations() == {
        "weights": 5.0,
        "kv_cache": 1.0,
        "cuda_graph": 4.28,
        "warmup": 1.8,
    }


def test_after_fatal_only_a_new_load_fires() -> None:
    text = (FIXTURES / "sglang-fatal.log").read_text()
    result = replay(text + "[2026-03-02 11:00:10] Rank 2 scheduler died during initialization\n")
    assert result.kinds.count("fatal") == 1
    fatal = result.first("fatal")
    assert fatal.detail == (
        "Rank 0 scheduler died during initialization (exit code: 1); cause: RuntimeError: Not "
        "enough memory. Please try to increase --mem-fraction-static."
    )
    assert result.timeline.fatal == fatal.detail


def test_event_time_rules() -> None:
    at = time.mktime((2026, 3, 2, 10, 0, 5, 0, 0, -1))
    line = "[2026-03-02 10:00:05] Load weight begin. avail mem=1 GB\n"
    # Whole-second stamp: the reference refines it within its second, and never past it.
    assert MarkerParser("sglang").feed(line, at + 0.4)[0].time == at + 0.4
    assert MarkerParser("sglang").feed(line, at + 3.0)[0].time == at + 1.0
    # A container logging two hours behind the exporter's zone: corrected by whole hours.
    assert MarkerParser("sglang").feed(line, at + 7200.3)[0].time == at + 7200.3
    # Nonsense stamps (far off, not a zone difference) lose to the reference.
    assert MarkerParser("sglang").feed(line, at + 500.0)[0].time == at + 500.0
    assert MarkerParser("sglang").feed(line, at + 86400.0 * 3)[0].time == at + 86400.0 * 3
    # vLLM has no year: a December line read just after New Year is last year's.
    new_year = time.mktime((2027, 1, 1, 0, 0, 2, 0, 0, -1))
    vllm = "INFO 12-31 23:59:59 [gpu_model_runner.py:2626] Loading model from scratch...\n"
    event = MarkerParser("vllm").feed(vllm, new_year)[0]
    assert event.time == time.mktime((2026, 12, 31, 23, 59, 59, 0, 0, -1)) + 1.0


def test_step_timeline_rules() -> None:
    timeline = StepTimeline()
    parser = MarkerParser("vllm")
    log = [
        (10.0, "INFO 03-02 10:00:00 [x.py:1] Loading model from scratch..."),
        (30.0, "INFO 03-02 10:00:20 [x.py:1] Loading weights took 20.00 seconds"),
        (35.0, "INFO 03-02 10:00:25 [x.py:1] Dynamo bytecode transform time: 3.00 s"),
        (45.0, "INFO 03-02 10:00:35 [x.py:1] Available KV cache memory: 1.00 GiB"),
    ]
    for ref, line in log:
        for event in parser.feed(line, ref):
            timeline.apply(event)
    assert timeline.step is Step.KV_CACHE and timeline.since == 45.0
    # Between weights_end (30) and compile (35) no step ran; compile ran until the KV cache.
    assert timeline.durations == {Step.WEIGHTS: 20.0, Step.COMPILE: 10.0}


def test_an_end_line_that_states_its_duration_counts_without_its_begin() -> None:
    timeline = StepTimeline()
    parser = MarkerParser("vllm")
    log = [
        (45.0, "INFO 03-02 10:00:35 [x.py:1] Available KV cache memory: 1.00 GiB"),
        (50.0, "INFO 03-02 10:00:40 [x.py:1] Graph capturing finished in 3 secs, took 0.5 GiB"),
    ]
    for ref, line in log:
        for event in parser.feed(line, ref):
            timeline.apply(event)
    # The graphs ran 47..50 by their own account: the KV cache step ended where they began.
    assert timeline.durations == {Step.KV_CACHE: 2.0, Step.CUDA_GRAPH: 3.0}
    assert timeline.step is Step.NONE


# The end-line rule on varied shapes (issue 32, row 1): (format, log lines as (seconds, line),
# the steps they must give). `{v}` is a vLLM stamp, `{s}` SGLang's, of the line's own second.
_V, _VO = (
    "(EngineCore_DP0 pid=9) INFO {v} [r.py:1] ",
    "(VllmWorker rank=0 pid=9) INFO {v} [r.py:1] ",
)
END_LINE_SHAPES = {
    "vllm: after the KV cache lines, no begin": ("vllm", [
        (10, _V + "Available KV cache memory: 1.00 GiB"),
        (10, "(EngineCore_DP0 pid=8) INFO {v} [k.py:1] GPU KV cache size: 9,000 tokens"),
        (13, _V + "Graph capturing finished in 3 secs, took 0.45 GiB"),
        (14, "(APIServer pid=7) INFO {v} [a.py:1] init engine (profile, create kv cache, warmup model) took 5.00 seconds"),
    ], {Step.KV_CACHE: 0.0, Step.CUDA_GRAPH: 3.0}),
    "vllm-old: another process's KV line, then the worker's end line": ("vllm", [
        (10, "INFO {v} [executor_base.py:1] # cuda blocks: 1000, # CPU blocks: 500"),
        (14, _VO + "Graph capturing finished in 3 secs, took 0.45 GiB"),
    ], {Step.KV_CACHE: 1.0, Step.CUDA_GRAPH: 3.0}),
    "vllm-old: no step open at all": ("vllm", [
        (10, _VO + "Loading weights took 2.00 seconds"),
        (22, _VO + "torch.compile takes 12.5 s in total"),
    ], {Step.WEIGHTS: 2.0, Step.COMPILE: 12.5}),
    "vllm: each rank and a second wording tell the same step": ("vllm", [
        (30, _V + "Loading weights took 20.00 seconds"),
        (30, _V.replace("EngineCore_DP0", "Worker_TP1") + "Loading weights took 20.50 seconds"),
        (31, _V + "Model loading took 9.5 GiB and 20.9 seconds"),
    ], {Step.WEIGHTS: 20.0}),
    "sglang: prefill then decode graphs, their begin lines missed": ("sglang", [
        (10, "[{s}] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 16384"),
        (13, "[{s}] Capture target prefill CUDA graph end. elapsed=2.00 s, mem usage=0.10 GB, avail mem=9.00 GB."),
        (17, "[{s}] Capture target decode CUDA graph end. bs=[1, 2, 4], elapsed=4.00 s, mem usage=0.10 GB, avail mem=8.90 GB."),
    ], {Step.KV_CACHE: 1.0, Step.CUDA_GRAPH: 6.0}),
    "sglang: a weights end line read from the middle, a CPU graph after": ("sglang", [
        (16, "[{s}] Load weight end. elapsed=6.37 s, type=LlamaForCausalLM, avail mem=18.93 GB, mem usage=1.34 GB."),
        (18, "[{s}] KV Cache is allocated. dtype: torch.float32, #tokens: 16384"),
        (21, "[{s}] Capture target decode CPU graph end. bs=[1], elapsed=2.50 s, mem usage=0.00 GB, avail mem=8.90 GB."),
    ], {Step.WEIGHTS: 6.37, Step.KV_CACHE: 0.5, Step.CUDA_GRAPH: 2.5}),
    # SGLang's `kv_cache_allocation=` (its Engine startup timings) dates the KV cache's begin.
    "sglang: the KV cache's line a second after its allocation, timed the next second": ("sglang", [
        (16, "[{s}] Load weight end. elapsed=6.37 s, type=LlamaForCausalLM, avail mem=18.93 GB, mem usage=1.34 GB."),
        (19, "[{s}] KV Cache is allocated. dtype: torch.float32, #tokens: 16384, K size: 0.06 GB, V size: 0.06 GB"),
        (20, "[{s}] Engine startup timings (s): load_weight=6.37, kv_cache_allocation=1.50, scheduler_e2e=13.55, cuda_graph={prefill=0.00, decode=0.00}, tokenizer_e2e=30.00"),
        (21, "[{s}] INFO:     Application startup complete."),
    ], {Step.WEIGHTS: 6.37, Step.KV_CACHE: 3.5, Step.WARMUP: 0.0}),
    "sglang: an allocation stated longer than the gap since the weights ended": ("sglang", [
        (16, "[{s}] Load weight end. elapsed=6.37 s, type=LlamaForCausalLM, avail mem=18.93 GB, mem usage=1.34 GB."),
        (17, "[{s} TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 900000"),
        (17, "[{s}] Engine startup timings (s): load_weight=6.37, kv_cache_allocation=4.00, scheduler_e2e=60.00"),
        (18, "[{s}] INFO:     Waiting for application startup."),
    ], {Step.WEIGHTS: 6.37, Step.KV_CACHE: 2.0, Step.WARMUP: 0.0}),
    "sglang: the KV line missed, the timings line alone": ("sglang", [
        (16, "[{s}] Load weight end. elapsed=6.37 s, type=LlamaForCausalLM, avail mem=18.93 GB, mem usage=1.34 GB."),
        (20, "[{s}] Engine startup timings (s): load_weight=6.37, kv_cache_allocation=1.25, scheduler_e2e=13.55"),
        (21, "[{s}] INFO:     Application startup complete."),
    ], {Step.WEIGHTS: 6.37, Step.KV_CACHE: 1.25, Step.WARMUP: 0.0}),
    "sglang: graphs after the KV cache, timed once all is done": ("sglang", [
        (10, "[{s}] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 16384"),
        (11, "[{s}] Capture cuda graph begin. This can take up to several minutes. avail mem=9.00 GB"),
        (15, "[{s}] Capture cuda graph end. Time elapsed: 4.00 s. mem usage=0.10 GB. avail mem=8.90 GB."),
        (16, "[{s}] Engine startup timings (s): load_weight=6.37, kv_cache_allocation=0.80, scheduler_e2e=13.55"),
    ], {Step.KV_CACHE: 1.8, Step.CUDA_GRAPH: 4.0}),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(END_LINE_SHAPES))
def test_an_end_line_stating_its_duration_counts_whatever_came_before(shape: str) -> None:
    """Each line is read as it is written (stamp + 0.2 s): the step ends at the line, began the
    seconds it states before, and a step still open ended there."""
    fmt, lines, expected = END_LINE_SHAPES[shape]
    base = time.mktime((2026, 3, 2, 10, 0, 0, 0, 0, -1))
    timeline, parser = StepTimeline(), MarkerParser(fmt)
    for second, line in lines:
        stamp = time.localtime(base + second)
        text = line.replace("{v}", time.strftime("%m-%d %H:%M:%S", stamp))
        text = text.replace("{s}", time.strftime("%Y-%m-%d %H:%M:%S", stamp))
        for event in parser.feed(text + "\n", base + second + 0.2):
            timeline.apply(event)
    timeline.close(base + lines[-1][0] + 0.2)
    assert timeline.durations == pytest.approx(expected, abs=0.25), timeline.durations


@pytest.mark.parametrize(
    ("began", "ended", "seconds", "expected"),
    [
        (10.0, 16.0, 5.3, (10.0, 15.3)),  # the end line read late
        (10.0, 16.0, 6.7, (9.3, 16.0)),  # the begin line read late
        (10.0, 16.0, None, (10.0, 16.0)),  # no duration stated
        (10.0, 16.0, 2.0, (10.0, 16.0)),  # it measured something shorter: the lines stand
        (10.0, 16.0, 9.0, (10.0, 16.0)),  # or longer
    ],
)
def test_a_stated_duration_tightens_the_lines_within_a_stamps_second(
    began: float, ended: float, seconds: float | None, expected: tuple[float, float]
) -> None:
    assert tighten(began, ended, seconds) == pytest.approx(expected)


SIMULATED_STEPS = {
    "sglang": {"kv_cache", "compile_begin", "cuda_graph_begin", "cuda_graph_end", "warmup_begin"},
    "vllm": {"compile_begin", "compile_end", "kv_cache", "cuda_graph_begin", "cuda_graph_end"},
    "llamacpp": {"weights_progress", "kv_cache", "warmup_begin"},
    "tgi": {"warmup_begin", "kv_cache", "cuda_graph_begin", "cuda_graph_end"},
}


@pytest.mark.parametrize("kind", sorted(LOG_WRITERS))
@pytest.mark.parametrize("crash", [None, "weights", "init"])
def test_simulator_output_is_recognised(kind: str, crash: str | None) -> None:
    """Exactly what `simulate --log-format KIND` writes, success and each failure stage."""
    out = io.StringIO()
    clock = itertools.count(1_800_000_000, 0.25)
    ctx = LogContext("m", "/models/m", 42, "http://127.0.0.1:1", "127.0.0.1", 1, 4 << 30, 4, "ext4")
    log = LOG_WRITERS[kind](out, ctx, clock=lambda: float(next(clock)))
    log.banner()
    log.weights_begin()
    for shard in range(1, 5):
        log.weights_bytes(shard << 30, shard * 3.0)
        log.shard_done(shard, shard * 3.0)
    if crash == "weights":
        log.failure("weights", "boom in weights")
    else:
        log.weights_end(12.0)
        for step in log.steps:
            log.step_begin(step)
            for tick in range(1, log.ticks.get(step, 1) + 1):
                log.step_tick(step, tick, log.ticks.get(step, 1), 1.0)
            if crash == "init" and step == log.steps[-1]:
                log.failure(step, "boom in init")
                break
            log.step_end(step, 1.0)
        else:
            log.ready()
    result = replay(out.getvalue(), start=1_800_000_000)
    assert result.parser.format == kind
    kinds = result.kinds
    assert kinds[0] == "weights_begin"
    if crash is None:
        assert kinds[-1] == "ready"
        assert "weights_end" in kinds
        assert SIMULATED_STEPS[kind] <= set(kinds)
    else:
        assert kinds[-1] == "fatal"
        assert f"boom in {crash}" in result.events[-1].detail


@pytest.mark.parametrize("fmt", [AUTO, *SERVERS])
def test_config_accepts_every_format_the_parser_knows(fmt: str) -> None:
    target = {"name": "t", "endpoint": {"url": "http://127.0.0.1:1"}}
    config = parse_config({"targets": [{**target, "log": {"file": "/x.log", "format": fmt}}]})
    log = config.targets[0].log
    assert log is not None and log.format == fmt
    assert MarkerParser(log.format).format == (None if fmt == AUTO else fmt)


def test_a_later_step_implies_the_weights_are_in() -> None:
    """A release whose "weights done" line is not known still gets the boundary."""
    log = [
        "(Worker_TP0 pid=1) INFO 03-02 10:00:00 [x.py:1] Loading model from scratch...",
        "(Worker_TP1 pid=2) INFO 03-02 10:00:00 [x.py:1] Loading model from scratch...",
        "(Worker_TP0 pid=1) INFO 03-02 10:00:20 [x.py:1] Weights are in, said differently",
        "(Worker_TP0 pid=1) Capturing CUDA graphs (PIECEWISE):   0%|          | 0/4 [00:00<?]",
    ]
    result = replay("\n".join(log), "vllm")
    assert result.kinds == [
        "weights_begin",
        "weights_end",
        "cuda_graph_begin",
        "cuda_graph_progress",
    ]
    end = result.first("weights_end")
    assert end.detail.startswith("implied by: Capturing CUDA graphs") and end.implied
    assert result.durations() == {"weights": 20.1}


def test_vllms_ranks_after_the_first_write_no_end_of_their_weights() -> None:
    """Real vLLM 0.32 at TP 2: TP0's "Loading weights took" leaves TP1's weights open, and the
    end comes implied (a bound, not a date); at TP 1 the end line states it."""
    tp2 = replay_fixture("vllm-0.32-cpu-tp2-cold.log")
    end = tp2.first("weights_end")
    assert end.implied and end.detail.startswith("implied by: Warming up model")
    one = replay_fixture("vllm-0.32-cpu-cold.log").first("weights_end")
    assert not one.implied and one.detail == "Loading weights took 12.04 seconds"
    killed = replay_fixture("vllm-0.32-cpu-tp2-rank-killed.log").first("fatal")
    assert killed.detail == "[shutdown] Executor: waiting for worker exit count=1"


def test_a_bar_read_late_does_not_push_the_next_stamped_line_past_its_second() -> None:
    """Real SGLang, warm: the weights bar's last redraw has no stamp and is dated when read;
    "Load weight end" was still written within its own stamped second."""
    base = time.mktime((2026, 12, 2, 8, 55, 0, 0, 0, -1))
    parser = MarkerParser("sglang")
    parser.feed("[2026-12-02 08:55:04] Load weight begin. avail mem=18.66 GB\n", base + 5.2)
    bar = "Multi-thread loading shards: 100% Completed | 4/4 [00:01<00:00,  2.90it/s]\n"
    [progress] = parser.feed(bar, base + 6.39)
    [end] = parser.feed(
        "[2026-12-02 08:55:05] Load weight end. elapsed=1.39 s, type=LlamaForCausalLM\n",
        base + 6.4,
    )
    assert progress.time == base + 6.39
    assert end.time == base + 6.0 and end.seconds == 1.39


NOISE_SHAPES = {
    "short": lambda i: f"{i}\n",
    "pip": lambda i: f"Requirement already satisfied: pkg{i} in /usr/lib/python3/dist-packages\n",
    "tqdm-redraws": lambda i: f"Downloading: {i % 100:3d}%|#####     | {i}/99999\r",
    "crlf-and-blank": lambda i: f"[{i}] not a stamp\r\n\n",
    "utf8-and-ansi": lambda i: f"\x1b[33mwarn\x1b[0m héllo wörld ✓ {i}\n",
}


@pytest.mark.parametrize("shape", NOISE_SHAPES)
def test_a_log_no_format_knows_is_not_checked_line_by_line(
    monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """`auto` over 200,000 lines no format writes, in chunks as the source feeds them: the
    per-line check runs only on lines a signature could start (none here), and the first line
    that names a format is still found, with its line number."""
    calls = []

    def counted(line: str) -> str | None:
        calls.append(line)
        return detect(line)

    monkeypatch.setattr("exporter.logs.markers.detect", counted)
    make = NOISE_SHAPES[shape]
    parser = MarkerParser("auto")
    lines = 0
    for chunk in range(20):
        text = "".join(make(chunk * 10_000 + i) for i in range(10_000))
        assert parser.feed(text, 1.0) == []
        lines += text.count("\n") + text.count("\r") - text.count("\r\n")
    assert calls == [] and parser.format is None and parser.unknown_announced
    vllm = "INFO 03-02 10:00:00 [loader.py:1] Loading weights took 3.21 seconds\n"
    events = parser.feed(make(0) + vllm, 2.0)
    assert parser.format == "vllm" and len(calls) == 1
    before = as_lines(make(0)).count("\n")
    assert f"auto: line {lines + before + 1} matched vllm" in parser.format_reason
    assert [e.kind for e in events] == [EventKind.WEIGHTS_END]
