"""``mtpserve serve``: run the API and metrics servers, drain on SIGTERM, reload tenants on SIGHUP.

SIGTERM (or SIGINT): new requests get 503 and ``/ready`` fails, in-flight requests run to the end
(up to ``--drain-timeout``), then both servers stop, every session is closed (its KV zeroed) and
the process exits 0. Without ``--tenants`` one development tenant is created and its random key
is printed once on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import uvicorn
from pydantic import ValidationError

from app.logging import configure_logging
from app.main import create_app
from app.metrics_app import build_metrics_app
from app.service import Service
from app.settings import Settings
from app.tenants import TenantConfigError, TenantRegistry

log = logging.getLogger("mtpserve.server")


def _depths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated depths, e.g. 4,6, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtpserve serve", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", type=Path, help="model folder (default: models/demo)")
    add("--served-model-name", help="model id in the API (default: the folder name)")
    add("--host", help="API host (default 0.0.0.0)")
    add("--port", type=int, help="API port (default 8000)")
    add("--metrics-host", help="metrics host (default: --host)")
    add("--metrics-port", type=int, help="metrics port (default 9464)")
    add("--tenants", type=Path, help="tenants TOML file (default: one dev tenant)")
    add("--device", help="cpu or cuda")
    add("--dtype", help="float32, bfloat16, ...")
    add("--max-batch", type=int, help="maximum running requests")
    add("--kv-memory-mb", type=int, help="KV cache memory budget in MiB")
    add("--block-size", type=int, help="KV block size in tokens")
    add("--max-model-len", type=int, help="context length limit")
    add("--prefill-chunk-tokens", type=int, help="prefill chunk size")
    add(
        "--spec-method",
        choices=["none", "chain", "tree", "adaptive"],
        help="speculation (default adaptive: chosen per step by measured cost)",
    )
    add("--spec-topk", type=int)
    add("--spec-depth", type=int)
    add("--spec-num-draft-tokens", type=int)
    add("--spec-chain-depths", type=_depths, help="adaptive: its chain arms' depths, e.g. 4,6")
    add("--max-waiting", type=int, help="waiting queue bound (429 beyond)")
    add("--max-body-bytes", type=int)
    add("--session-idle-timeout-s", type=float)
    add("--drain-timeout-s", type=float)
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add("--log-text", action="store_true", default=None, help="DEBUG: log prompt/completion text")
    return p


def settings_from_argv(argv: Sequence[str] | None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return Settings(**overrides)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (it would re-raise SIGTERM at exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: Any, host: str, port: int, lifespan: Literal["on", "off"]) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
        timeout_graceful_shutdown=5,
    )  # fmt: skip


async def _watch_engine(
    service: Service, stop: asyncio.Event, exit_code: list[int], poll_s: float = 0.1
) -> None:
    """Exit (code 1, for the supervisor to restart the process) if the model fails to load,
    or later if the engine fails a step it cannot recover from (``EngineLoop.fault``)."""
    while service.loop.load_error is None and not service.loop.ready:
        await asyncio.sleep(poll_s)
    if service.loop.load_error is not None:
        log.error("the model failed to load; exiting")
        exit_code[0] = 1
        stop.set()
        return
    log.info("model loaded", extra={"fields": {"model": service.model_name}})
    while service.loop.fault is None:
        await asyncio.sleep(poll_s)
    log.error("the engine failed a step it could not recover from; exiting to be restarted")
    exit_code[0] = 1
    stop.set()


async def serve(settings: Settings, tenants: TenantRegistry) -> int:
    app = create_app(settings, tenants, freeze_gc=True)  # this process serves this app only
    service: Service = app.state.service
    api = _Server(_config(app, settings.host, settings.port, "on"))
    metrics_host = settings.metrics_host or settings.host
    metrics = _Server(
        _config(build_metrics_app(service), metrics_host, settings.metrics_port, "off")
    )
    stop = asyncio.Event()
    exit_code = [0]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload_tenants() -> None:
        if tenants.reload():
            service.update_session_gauge()

    loop.add_signal_handler(signal.SIGHUP, reload_tenants)
    api_task = asyncio.create_task(api.serve())
    metrics_task = asyncio.create_task(metrics.serve())
    watcher = asyncio.create_task(_watch_engine(service, stop, exit_code))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({api_task, metrics_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down: draining requests")
    await service.drain()
    api.should_exit = metrics.should_exit = True
    await asyncio.gather(api_task, metrics_task, return_exceptions=True)
    for task in (watcher, stopper):
        task.cancel()
    log.info("stopped")
    return exit_code[0]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = settings_from_argv(argv)
    except ValidationError as exc:
        first = exc.errors()[0]
        print(
            f"mtpserve serve: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr
        )
        return 2
    configure_logging(settings.log_level)
    if settings.tenants is not None:
        try:
            tenants = TenantRegistry.from_file(settings.tenants)
        except TenantConfigError as exc:
            print(f"mtpserve serve: {exc}", file=sys.stderr)
            return 2
    else:
        tenants, key = TenantRegistry.development()
        print(f"mtpserve: no --tenants file; development tenant 'dev' API key: {key}", flush=True)
    return asyncio.run(serve(settings, tenants))
