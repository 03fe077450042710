"""Startup log lines in the real formats of SGLang, vLLM, llama.cpp and TGI (see
`shared/reference/server-startup.md`), so log readers and people see what they would see."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TextIO

import psutil

from exporter.units import MiB
from exporter.vocabulary import ServerKind

GiB = 1 << 30
# How `--init-seconds` is shared between the fine steps a format goes through.
STEP_SHARES: dict[str, float] = {
    "kv_cache": 0.1,
    "compile": 0.35,
    "cuda_graph": 0.4,
    "warmup": 0.15,
}
# The GPU is imaginary; its numbers only need to be plausible for an 80 GB card.
GPU_AVAILABLE_GB = 79.11


@dataclass(frozen=True)
class LogContext:
    model: str
    model_path: str
    pid: int
    url: str
    host: str
    port: int
    weights_bytes: int
    shards: int
    fs_type: str
    tensor_parallel: int = 1


def _interval(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def tqdm_meter(desc: str, done: int, total: int, elapsed: float, *, bar: bool = False) -> str:
    """A tqdm status line as the servers print it (SGLang and vLLM use the `Completed |` form)."""
    percent = 100.0 * done / total if total else 100.0
    rate = done / elapsed if done and elapsed > 0 else None
    if rate is None:
        remaining, rate_text = "?", "?it/s"
    else:
        remaining = _interval((total - done) / rate)
        rate_text = f"{1 / rate:5.2f}s/it" if rate < 1 else f"{rate:5.2f}it/s"
    if bar:
        filled = int(10 * done / total) if total else 10
        middle = f"{percent:3.0f}%|{'█' * filled}{' ' * (10 - filled)}|"
    else:
        middle = f"{percent:3.0f}% Completed |"
    return f"{desc}: {middle} {done}/{total} [{_interval(elapsed)}<{remaining}, {rate_text}]"


class ServerLog:
    """Writes one server's startup log; subclasses supply the wording of each event.

    Lines that tqdm would redraw in place are written with a leading `\\r` and no newline, as the
    real progress bars are; the next regular line first ends such an open line.
    """

    kind: ClassVar[ServerKind]
    steps: ClassVar[tuple[str, ...]] = ()
    ticks: ClassVar[dict[str, int]] = {}
    # SGLang opens its port before its warmup request; /health answers 503 until that succeeds.
    opens_port_for_warmup: ClassVar[bool] = False
    # A model over several hosts: the steps its head alone runs (a follower node skips them),
    # and whether this server runs followers at all (`node_up` writes a follower's last line).
    head_steps: ClassVar[tuple[str, ...]] = ()
    has_followers: ClassVar[bool] = False

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        self._out = out
        self.ctx = ctx
        self._clock = clock
        self._open_line = False
        self.timings: dict[str, float] = {}

    @property
    def weights_gb(self) -> float:
        return self.ctx.weights_bytes / GiB

    @property
    def avail_after_weights(self) -> float:
        return max(GPU_AVAILABLE_GB - self.weights_gb, 1.0)

    def prefix(self, **fields: str) -> str:
        return ""

    def line(self, message: str, **fields: str) -> None:
        text = self.prefix(**fields) + message + "\n"
        self._write(("\n" if self._open_line else "") + text)
        self._open_line = False

    def raw(self, text: str) -> None:
        """Unprefixed output (tqdm bars, tracebacks); an unterminated one stays open."""
        self._write(text)
        self._open_line = not text.endswith("\n")

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()

    def banner(self) -> None:
        """Lines before the weights begin to move."""

    def weights_begin(self) -> None:
        """The weight load starts."""

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        """Called after every chunk."""

    def shard_done(self, done: int, elapsed: float) -> None:
        """Called after every weight file."""

    def weights_end(self, seconds: float) -> None:
        """All weights are in."""

    def step_begin(self, step: str) -> None:
        """A fine step of initialization starts (kv_cache, compile, cuda_graph, warmup)."""

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        """Progress within a step, `ticks[step]` times."""

    def step_end(self, step: str, seconds: float) -> None:
        """A fine step ended after `seconds`."""

    def ready(self) -> None:
        """The endpoint is ready."""

    def node_up(self) -> None:
        """A follower node's part of the model is up: its last start-up line."""

    def failure(self, stage: str, reason: str) -> None:
        """The scripted crash in `stage` (weights or an init step); the process exits 1 next."""


class SGLangLog(ServerLog):
    kind = ServerKind.SGLANG
    steps = ("kv_cache", "compile", "cuda_graph", "warmup")
    ticks: ClassVar[dict[str, int]] = {"compile": 4, "cuda_graph": 9}
    opens_port_for_warmup = True
    head_steps = ("warmup",)  # node 0's HTTP server sends the warm-up request
    has_followers = True
    _BATCH_SIZES = (256, 128, 64, 32, 16, 8, 4, 2, 1)
    _COMPILE_TOKENS = (8192, 4096, 2048, 1024)

    def prefix(self, **fields: str) -> str:
        return time.strftime("[%Y-%m-%d %H:%M:%S] ", time.localtime(self._clock()))

    def _kv_tokens(self) -> int:
        return int(self.avail_after_weights * 0.85 * 8192)

    def banner(self) -> None:
        c = self.ctx
        self.line(
            f"server_args=ServerArgs(model_path='{c.model_path}', tokenizer_path='{c.model_path}', "
            f"host='{c.host}', port={c.port}, served_model_name='{c.model}', "
            f"tp_size={c.tensor_parallel}, "
            "dtype='auto', mem_fraction_static=0.85, random_seed=0)"
        )
        self.line("Init parallel begin.")
        self.line("Init parallel ends. elapsed=0.03 s")

    def weights_begin(self) -> None:
        self.line(f"Load weight begin. avail mem={GPU_AVAILABLE_GB:.2f} GB")
        self.raw("\r" + tqdm_meter("Loading safetensors checkpoint shards", 0, self.ctx.shards, 0))

    def shard_done(self, done: int, elapsed: float) -> None:
        meter = tqdm_meter("Loading safetensors checkpoint shards", done, self.ctx.shards, elapsed)
        self.raw("\r" + meter + ("\n" if done == self.ctx.shards else ""))

    def weights_end(self, seconds: float) -> None:
        self.timings["load_weight"] = seconds
        self.line(
            f"Load weight end. elapsed={seconds:.2f} s, type=LlamaForCausalLM, "
            f"dtype=torch.bfloat16, avail mem={self.avail_after_weights:.2f} GB, "
            f"mem usage={self.weights_gb:.2f} GB."
        )

    def step_begin(self, step: str) -> None:
        avail = self.avail_after_weights
        if step == "compile":
            self.line("Entering DeepGEMM JIT Pre-Compile session. It may take a long time.")
        elif step == "cuda_graph":
            self.line(
                "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
                f"avail mem={avail * 0.15:.2f} GB"
            )
            self.raw("\r" + self._capture_meter(0, 0.0))
        elif step == "warmup":
            graphs = f"prefill=0.00, decode={self.timings.get('cuda_graph', 0):.2f}"
            self.line(
                f"Engine startup timings (s): load_weight={self.timings.get('load_weight', 0):.2f}"
                f", kv_cache_allocation={self.timings.get('kv_cache', 0):.2f}, "
                f"deep_gemm_compile={self.timings.get('compile', 0):.2f}, cuda_graph={{{graphs}}}"
            )
            self.line(
                f"max_total_num_tokens={self._kv_tokens()}, chunked_prefill_size=8192, "
                "max_prefill_tokens=16384, max_running_requests=4096, context_len=131072, "
                f"available_gpu_mem={avail * 0.14:.2f} GB"
            )
            self.line(f"INFO:     Started server process [{self.ctx.pid}]")
            self.line("INFO:     Waiting for application startup.")
            self.line("INFO:     Application startup complete.")
            self.line(f"INFO:     Uvicorn running on {self.ctx.url} (Press CTRL+C to quit)")

    def _capture_meter(self, done: int, elapsed: float) -> str:
        index = min(done, len(self._BATCH_SIZES) - 1)
        desc = f"Capturing batches (bs={self._BATCH_SIZES[index]} avail_mem="
        desc += f"{self.avail_after_weights * 0.15:.2f} GB)"
        return tqdm_meter(desc, done, len(self._BATCH_SIZES), elapsed, bar=True)

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        if step == "compile":
            self.line(f"Compiling num tokens (num_tokens={self._COMPILE_TOKENS[done - 1]})")
        elif step == "cuda_graph":
            end = "\n" if done == count else ""
            self.raw("\r" + self._capture_meter(done, elapsed) + end)

    def step_end(self, step: str, seconds: float) -> None:
        self.timings[step] = seconds
        if step == "kv_cache":  # as SGLang's pool is made: its lines once the memory is taken
            size = self.avail_after_weights * 0.85 / 2
            self.line(
                f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {self._kv_tokens()}, "
                f"K size: {size:.2f} GB, V size: {size:.2f} GB"
            )
            self.line(f"Memory pool end. avail mem={self.avail_after_weights * 0.15:.2f} GB")
        elif step == "cuda_graph":
            sizes = ", ".join(map(str, reversed(self._BATCH_SIZES)))
            self.line(
                f"Capture target decode CUDA graph end. bs=[{sizes}], elapsed={seconds:.2f} s, "
                f"mem usage=0.52 GB, avail mem={self.avail_after_weights * 0.14:.2f} GB."
            )
        elif step == "warmup":
            self.line('INFO:     127.0.0.1:50412 - "GET /get_model_info HTTP/1.1" 200 OK')
            self.line(
                "Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
                "#running-req: 0, #queue-req: 0, "
            )
            self.line('INFO:     127.0.0.1:50414 - "POST /generate HTTP/1.1" 200 OK')

    def ready(self) -> None:
        self.line("The server is fired up and ready to roll!")

    def node_up(self) -> None:
        address = f"{self.ctx.host}:{self.ctx.port}"
        self.line(f"Dummy health check server started in background thread at {address}")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "warmup":
            self.line(f"Initialization failed. warmup error: RuntimeError: {reason}")
            return
        self.line("Scheduler hit an exception: Traceback (most recent call last):")
        self.raw(
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", '
            "line 2981, in run_scheduler_process\n"
            f"RuntimeError: {reason}\n"
        )
        self.line("Rank 0 scheduler died during initialization (exit code: 1)")


class VLLMLog(ServerLog):
    kind = ServerKind.VLLM
    steps = ("compile", "kv_cache", "cuda_graph", "warmup")
    ticks: ClassVar[dict[str, int]] = {"compile": 2, "cuda_graph": 4}
    # The engine's summary is the head's (its EngineCore); a headless node's worker ends with
    # its CUDA graphs' line, which is its node_up.
    head_steps = ("warmup",)
    has_followers = True
    _VERSION = "0.33.0"
    _GRAPH_BATCHES = 67

    def prefix(self, **fields: str) -> str:
        proc = fields.get("proc", "EngineCore")
        head = f"({proc} pid={self.ctx.pid}) "
        if "source" not in fields:
            return head
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(self._clock()))
        return f"{head}{fields.get('level', 'INFO')} {stamp} [{fields['source']}] "

    def _api(self, message: str, source: str) -> None:
        self.line(message, proc="APIServer", source=source)

    def banner(self) -> None:
        c = self.ctx
        self._api(
            f"vLLM server version {self._VERSION}, serving model {c.model_path}",
            "api_server.py:1932",
        )
        self._api(
            f"non-default args: {{'model': '{c.model_path}', 'host': '{c.host}', "
            f"'port': {c.port}, 'served_model_name': ['{c.model}']}}",
            "utils.py:328",
        )
        self.line(
            f"Initializing a V1 LLM engine (v{self._VERSION}) with config: model='{c.model_path}', "
            f"tokenizer='{c.model_path}', dtype=torch.bfloat16, max_seq_len=32768, "
            f"served_model_name={c.model}",
            source="core.py:77",
        )

    def weights_begin(self) -> None:
        c = self.ctx
        self.line("Loading model from scratch...", source="gpu_model_runner.py:2626")
        available = psutil.virtual_memory().available / GiB
        self.line(
            f"Filesystem type for checkpoints: {c.fs_type}. Checkpoint size: "
            f"{self.weights_gb:.2f} GiB. Available RAM: {available:.2f} GiB.",
            source="default_loader.py:268",
        )
        self.line(tqdm_meter("Loading safetensors checkpoint shards", 0, c.shards, 0))

    def shard_done(self, done: int, elapsed: float) -> None:
        self.line(
            tqdm_meter("Loading safetensors checkpoint shards", done, self.ctx.shards, elapsed)
        )

    def weights_end(self, seconds: float) -> None:
        self.line(f"Loading weights took {seconds:.2f} seconds", source="default_loader.py:312")
        self.line(
            f"Model loading took {self.weights_gb:.4f} GiB memory and {seconds + 0.21:.6f} seconds",
            source="gpu_model_runner.py:2658",
        )

    def step_begin(self, step: str) -> None:
        if step == "compile":
            self.line("Starting torch.compile of the model backbone", source="backends.py:548")
        elif step == "kv_cache":
            kv = self.avail_after_weights * 0.85
            self.line(f"Available KV cache memory: {kv:.2f} GiB", source="gpu_worker.py:298")
        elif step == "cuda_graph":
            self.line(self._capture_meter(0, 0.0))

    def _capture_meter(self, done: int, elapsed: float) -> str:
        desc = "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)"
        return tqdm_meter(desc, done, self._GRAPH_BATCHES, elapsed, bar=True)

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        if step == "compile" and done == 1:
            self.line(f"Dynamo bytecode transform time: {elapsed:.2f} s", source="backends.py:559")
        elif step == "compile":
            self.line(
                f"Compiling a graph for dynamic shape takes {elapsed / 2:.2f} s",
                source="backends.py:218",
            )
        elif step == "cuda_graph":
            self.line(self._capture_meter(self._GRAPH_BATCHES * done // count, elapsed))

    def step_end(self, step: str, seconds: float) -> None:
        self.timings[step] = seconds
        if step == "compile":
            self.line(f"torch.compile took {seconds:.2f} s in total", source="monitor.py:34")
        elif step == "kv_cache":
            tokens = int(self.avail_after_weights * 0.85 * 8192)
            self.line(f"GPU KV cache size: {tokens:,} tokens", source="kv_cache_utils.py:1087")
            self.line(
                f"Maximum concurrency for 32,768 tokens per request: {tokens / 32768:.2f}x",
                source="kv_cache_utils.py:1091",
            )
        elif step == "cuda_graph":
            self.line(
                f"Graph capturing finished in {round(seconds)} secs, took 0.52 GiB",
                source="gpu_model_runner.py:3480",
            )
        elif step == "warmup":
            total = sum(self.timings.values())
            self.line(
                f"init engine (profile, create kv cache, warmup model) took {total:.2f} seconds",
                source="core.py:210",
            )

    def ready(self) -> None:
        self._api(f"Starting vLLM server on {self.ctx.url}", "api_server.py:1971")
        self.line(f"INFO:     Started server process [{self.ctx.pid}]", proc="APIServer")
        self.line("INFO:     Waiting for application startup.", proc="APIServer")
        self.line("INFO:     Application startup complete.", proc="APIServer")

    def failure(self, stage: str, reason: str) -> None:
        for message in (
            "EngineCore failed to start.",
            "Traceback (most recent call last):",
            f"RuntimeError: {reason}",
        ):
            self.line(message, level="ERROR", source="core.py:708")
        self.line(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}",
            proc="APIServer",
        )


class LlamaCppLog(ServerLog):
    kind = ServerKind.LLAMACPP
    steps = ("kv_cache", "warmup")

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        super().__init__(out, ctx, clock)
        self._dots = 0

    def banner(self) -> None:
        c = self.ctx
        self.line("build: 6000 (0a1b2c3d) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu")
        self.line("system info: n_threads = 16, n_threads_batch = 16, total_threads = 16")
        self.line("main: binding port with default address family")
        self.line(
            f"main: HTTP server is listening, hostname: {c.host}, port: {c.port}, http threads: 15"
        )
        self.line("main: loading model")

    def weights_begin(self) -> None:
        c = self.ctx
        # llama-server's own line as it opens the GGUF: its weights begin here.
        self.line(f"srv    load_model: loading model '{c.model_path}'")
        self.line(
            "llama_model_loader: loaded meta data with 33 key-value pairs and 292 tensors from "
            f"{c.model_path} (version GGUF V3 (latest))"
        )
        self.line(f"print_info: file size   = {self.weights_gb:.2f} GiB (4.89 BPW)")
        self.line("load_tensors: loading model tensors, this can take a while... (mmap = true)")
        mib = c.weights_bytes / MiB
        self.line(f"load_tensors:        CUDA0 model buffer size = {mib:8.2f} MiB")

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        total = self.ctx.weights_bytes
        dots = 100 * loaded // total if total else 100
        if dots > self._dots:
            self.raw("." * (dots - self._dots) + ("\n" if dots == 100 else ""))
            self._dots = dots

    def step_begin(self, step: str) -> None:
        if step == "kv_cache":
            self.line("llama_context: constructing llama_context")
            self.line("llama_context: n_ctx         = 4096")
            self.line("llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB")
            self.line(
                "llama_kv_cache: size =  512.00 MiB (  4096 cells,  32 layers,  1/1 seqs), "
                "K (f16):  256.00 MiB, V (f16):  256.00 MiB"
            )
        elif step == "warmup":
            self.line(
                "common_init_from_params: warming up the model with an empty run - please wait "
                "... (--no-warmup to disable)"
            )

    def step_end(self, step: str, seconds: float) -> None:
        if step == "kv_cache":
            self.line("llama_context:      CUDA0 compute buffer size =   296.00 MiB")
            self.line("llama_context: graph nodes  = 1126")
        elif step == "warmup":
            self.line("srv          init: initializing slots, n_slots = 4")
            self.line("slot         init: id  0 | task -1 | new slot, n_ctx = 4096")

    def ready(self) -> None:
        self.line("srv          main: model loaded")
        self.line(f"main: server is listening on {self.ctx.url} - starting the main loop")
        self.line("srv  update_slots: all slots are idle")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "weights":
            self.line(f"llama_model_load: error loading model: {reason}")
            self.line("llama_model_load_from_file_impl: failed to load model")
        else:
            self.line(f"llama_init_from_model: failed to initialize the context: {reason}")
        self.line(f"srv    load_model: failed to load model, '{self.ctx.model_path}'")
        self.line("srv    operator(): operator(): cleaning up before exit...")
        self.line("main: exiting due to model loading error")


class TGILog(ServerLog):
    kind = ServerKind.TGI
    steps = ("warmup", "kv_cache", "cuda_graph")
    _WAIT_EVERY = 10.0
    _SHARD = "shard-manager: text_generation_launcher"
    _ROUTER = "text_generation_router_v3: backends/v3/src/lib.rs"

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        super().__init__(out, ctx, clock)
        self._waits = 0

    def prefix(self, **fields: str) -> str:
        now = self._clock()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        micros = int((now % 1) * 1e6)
        level = fields.get("level", "INFO")
        return (
            f"{stamp}.{micros:06d}Z {level:>5} {fields.get('target', 'text_generation_launcher')}: "
        )

    def banner(self) -> None:
        c = self.ctx
        self.line(
            f'Args {{ model_id: "{c.model_path}", revision: None, sharded: None, num_shard: None, '
            f'hostname: "{c.host}", port: {c.port}, served_model_name: "{c.model}" }}'
        )
        download = "download: text_generation_launcher"
        self.line(f"Starting check and download process for {c.model_path}", target=download)
        self.line("Files are already present on the host. Skipping download.", target=download)
        self.line(f"Successfully downloaded weights for {c.model_path}", target=download)

    def weights_begin(self) -> None:
        self.line("Starting shard rank=0", target=self._SHARD)

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        while elapsed >= (self._waits + 1) * self._WAIT_EVERY:
            self._waits += 1
            self.line("Waiting for shard to be ready... rank=0", target=self._SHARD)

    def weights_end(self, seconds: float) -> None:
        self.line(
            "Server started at unix:///tmp/text-generation-server-0 rank=0", target=self._SHARD
        )
        self.line(f"Shard ready in {seconds:.1f}s rank=0", target=self._SHARD)
        self.line("Starting Webserver")

    def step_begin(self, step: str) -> None:
        if step == "warmup":
            self.line("125: Warming up model", target=self._ROUTER)
        elif step == "kv_cache":
            blocks = int(self.avail_after_weights * 0.85 * 8192 / 16)
            self.line(f"KV-cache blocks: {blocks}, size: 16")
        elif step == "cuda_graph":
            self.line("Cuda Graphs are enabled for sizes [32, 16, 8, 4, 2, 1]")

    def step_end(self, step: str, seconds: float) -> None:
        if step == "cuda_graph":
            tokens = int(self.avail_after_weights * 0.85 * 8192)
            self.line(f"137: Setting max batch total tokens to {tokens}", target=self._ROUTER)

    def ready(self) -> None:
        self.line("router/src/server.rs:2400: Connected", target="text_generation_router::server")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "weights":
            self.line("Shard complete standard error output:\n", level="ERROR", target=self._SHARD)
            self.raw(f"RuntimeError: {reason}\n")
            self.line("Shard 0 failed to start", level="ERROR")
            self.line("Shutting down shards")
            self.raw("Error: ShardCannotStart\n")
        else:
            self.line(
                f"backends/v3/src/client/mod.rs:45: Server error: {reason}",
                level="ERROR",
                target="warmup:warmup: text_generation_router_v3::client",
            )
            self.raw(f'Error: Backend(Warmup(Generation("{reason}")))\n')


LOG_WRITERS: dict[ServerKind, type[ServerLog]] = {
    cls.kind: cls for cls in (SGLangLog, VLLMLog, LlamaCppLog, TGILog)
}


def fs_type(path: Path) -> str:
    """File system type of `path` (vLLM logs it), from the longest matching mount point."""
    target = os.path.realpath(path) + "/"
    best, fs_type = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") + "/"
        if target.startswith(mount) and len(mount) > len(best):
            best, fs_type = mount, part.fstype
    return fs_type
