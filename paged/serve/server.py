"""A server run: build the engine (or a fleet of them in this process) from a composed config, serve
it over HTTP until a signal, and leave the run's summary.json and requests.jsonl behind, as `run.py`
leaves a workload's.

SIGINT or SIGTERM (`paged.utils.interrupt`) stops admitting (new calls get 503), aborts what runs
with reason "interrupted" (their streams end with finish_reason "abort"), lets uvicorn close the
connections, and writes the outputs; a second signal quits at once. `BackgroundServer` runs the
same app in a thread of this process on an engine already built (the tests, the benchmark).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from paged.api.outputs import print_summary, write_outputs
from paged.cluster.fleet import Fleet
from paged.cluster.fleet_builder import build_fleet, check_fleet, uses_fleet
from paged.config import ConfigError
from paged.engine.builder import build_engine, check_config
from paged.engine.engine import Engine
from paged.engine.metrics import RequestMetrics
from paged.experiment.summary import summarize
from paged.serve.app import build_app
from paged.serve.engine_loop import INTERRUPTED, EngineLoop
from paged.serve.protocol import Limits
from paged.sim.executor import SimExecutor
from paged.utils.interrupt import Interrupt

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
# once stopped, how long uvicorn waits for the open responses (each aborted, so ending) before cutting them
GRACEFUL_SHUTDOWN_S = 30


def limits_for(cfg: Any, engine: Engine | Fleet) -> Limits:
    """What `engine`, built from `cfg`, accepts, and the model name it is served under."""
    s = cfg.scheduler
    name = cfg.server.served_model_name or cfg.model.name
    return Limits(name, s.max_model_len, s.max_num_seqs, engine.executor.vocab_size)


def check_server_config(cfg: Any) -> None:
    """What a server cannot run, before any weights load: a real model on the wall clock, one engine
    or a fleet of replicas (in this process or on Ray: `Fleet.abort` frees a request that a client
    left), on an address it can bind."""
    if uses_fleet(cfg):
        check_fleet(cfg)
        c = cfg.cluster
        if c.prefill_replicas > 0:  # check_fleet allows it with executor=sim only, refused below anyway
            raise ConfigError(f"cluster.prefill_replicas={c.prefill_replicas}: the server cannot run a disaggregated "
                              "fleet (it aborts only all its requests); use cluster.prefill_replicas=0")
    plugins = check_config(cfg)
    if issubclass(plugins.executor.cls, SimExecutor):
        raise ConfigError("executor=sim: the server runs a model on the wall clock; use executor=model")
    _check_bindable(cfg.server.host, cfg.server.port)


def _check_bindable(host: str, port: int) -> None:
    """Bind and release the address now: uvicorn would find it taken only after the weights loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(infos[0][4])
    except OSError as err:
        reason = err.strerror or err
        raise ConfigError(f"server.host={host} server.port={port}: cannot listen there ({reason})") from err


class _Uvicorn(uvicorn.Server):
    """Uvicorn with this project's signal handling: `interrupt` catches the signals (installed by
    the caller), and the first one stops the engine loop and the server."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, interrupt: Interrupt | None) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.interrupt = interrupt
        self.port: int | None = None
        self.ready = threading.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the caller's Interrupt holds SIGINT and SIGTERM; uvicorn's own would re-raise them at exit

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.servers:
            host, self.port = self.servers[0].sockets[0].getsockname()[:2]
            # on stderr, for a person and for scripts that started the server with port 0
            print(f"paged.serve: serving on http://{host}:{self.port}", file=sys.stderr, flush=True)
        self.ready.set()

    async def on_tick(self, counter: int) -> bool:
        if self.interrupt is not None and self.interrupt.requested and not self.should_exit:
            self.engine_loop.stop()
            self.should_exit = True
        return await super().on_tick(counter)


def _uvicorn(engine_loop: EngineLoop, limits: Limits, host: str, port: int, interrupt: Interrupt | None) -> _Uvicorn:
    app = build_app(engine_loop, limits)
    # no lifespan (the app has no startup work); keep-alive long enough for a benchmark client's pool
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", timeout_keep_alive=30,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return _Uvicorn(config, engine_loop, interrupt)


def serve(cfg: Any, run_dir: Path, interrupt: Interrupt) -> dict[str, Any]:
    """Serve `cfg`'s engine on cfg.server.host:port until `interrupt` is requested (a signal), then
    write summary.json and requests.jsonl into `run_dir`; returns the summary."""
    check_server_config(cfg)
    # Two threads share the GIL: the engine's and the HTTP loop's. Python hands it over every 5 ms by
    # default, as long as a small model's whole step: a chunk to send could wait that long each step
    # (tiny-random at 8 streams: 66% of offline tok/s over HTTP at 5 ms, 79% at 0.5 ms; one run each).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    start = time.perf_counter()
    engine = build_fleet(cfg) if uses_fleet(cfg) else build_engine(cfg)
    load_time = time.perf_counter() - start
    engine_loop = EngineLoop(engine)
    # the weights and the engine live as long as the server: frozen, the collector stops re-scanning
    # them at every collection, a pause of the engine's step that a stream shows as a late chunk (vLLM freezes so)
    gc.freeze()
    try:
        with interrupt.catching():
            engine_loop.start()
            server = _uvicorn(engine_loop, limits_for(cfg, engine), cfg.server.host, cfg.server.port, interrupt)
            served = time.perf_counter()
            server.run()
            engine_loop.stop()
            engine_loop.join()
            requests = engine_loop.requests
            summary = summarize(
                cfg, engine, host_time_s=time.perf_counter() - served, load_time_s=load_time,
                interrupted=any(r.abort_reason == INTERRUPTED for r in requests),
            )
            write_outputs(run_dir, summary, requests, [RequestMetrics.of(r) for r in requests], engine_loop.decode)
    finally:
        gc.unfreeze()
        _shutdown(engine)
    print_summary(summary, f"paged.serve: {cfg.allocator.name} | {cfg.scheduler.name} | {engine.executor.description}")
    log.info("wrote %s", run_dir)
    return summary


def _shutdown(engine: Engine | Fleet) -> None:
    """Release what `engine` holds outside this process (tensor-parallel workers)."""
    if isinstance(engine, Fleet):
        engine.shutdown()
    else:
        engine.executor.shutdown()


class BackgroundServer:
    """The server on an already built `engine`, in a thread of this process, on 127.0.0.1 and a free
    port by default: `url` once `start` returned. The engine must not be driven elsewhere meanwhile."""

    def __init__(self, engine: Engine | Fleet, limits: Limits, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine_loop = EngineLoop(engine)
        self._server = _uvicorn(self.engine_loop, limits, host, port, None)
        self._thread = threading.Thread(target=self._server.run, name="http-server", daemon=True)
        self._host = host

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._server.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.engine_loop.start()
        self._thread.start()
        if not self._server.ready.wait(timeout) or self._server.port is None:
            raise RuntimeError(f"the server did not start within {timeout} s")
        return self

    def stop(self) -> None:
        """Abort what runs, close the connections, stop both threads."""
        self.engine_loop.stop()
        self._server.should_exit = True
        self._thread.join()
        self.engine_loop.join()
        self.engine.metrics.step_listeners.remove(self.engine_loop.metrics.on_step)

    @property
    def engine(self) -> Engine | Fleet:
        return self.engine_loop.engine
