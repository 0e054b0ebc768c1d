"""What an app holds once it has started and answered: the modules it loaded, the objects the
garbage collector tracks (what every full collection walks, for as long as the worker lives)
and the growth of its peak resident memory, counted from an interpreter that had imported
nothing else.

``python -m bench.startup`` runs each app in a fresh interpreter: FastAPI alone, and the
README's FastAPI app with ``IdempotencyMiddleware`` on a ``MemoryStore`` and on
``RedisStore.from_url`` (Redis at ``--redis-url``). Each starts (its lifespan, with the
middleware's startup checks), answers a guarded POST and its replay, and is counted.
``--modules APP`` prints the modules that app loaded instead, one a line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import subprocess
import sys
import uuid
from typing import Any

APPS = ("bare", "memory", "redis")
_PATH = b"/payments"


def build(name: str, redis_url: str) -> Any:
    """The FastAPI app ``name``: ``bare`` has no idempotency; the others guard their POST as the
    README's does (a dict body: a model would have to be defined before the counting starts)."""
    from fastapi import FastAPI

    app = FastAPI()
    if name == "bare":

        @app.post("/payments")
        async def pay(body: dict[str, str]) -> dict[str, str]:
            return {"paymentId": "p_1", **body}

        return app

    import starlette_idempotency as idem  # each store's module loads only if it is used

    prefix = f"bench-startup-{uuid.uuid4().hex}"
    store: Any = (
        idem.MemoryStore()
        if name == "memory"
        else idem.RedisStore.from_url(redis_url, key_prefix=prefix)
    )
    app.add_middleware(idem.IdempotencyMiddleware, store=store)

    @app.post("/payments")
    @idem.idempotent(ttl_hours=0.01)  # 36 s: a run leaves nothing in Redis for long
    async def guarded_pay(body: dict[str, str]) -> dict[str, str]:
        return {"paymentId": "p_1", **body}

    return app


async def _post(app: Any, key: bytes) -> list[dict[str, Any]]:
    """What ``app`` sends for one JSON POST to /payments with ``key``, called as a server would."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": _PATH.decode(),
        "raw_path": _PATH,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"idempotency-key", key)],
        "server": ("bench", 80),
        "client": ("bench", 1),
        "state": {},
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"amount": "1.00"}', "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def serve(app: Any) -> None:
    """Start ``app`` (its lifespan), answer a POST and its replay, and shut it down."""
    startup, started, shutdown = asyncio.Event(), asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def receive() -> dict[str, Any]:
        if not startup.is_set():
            startup.set()
            return {"type": "lifespan.startup"}
        await shutdown.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        events.append(message["type"])
        started.set()

    lifespan = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    )
    await started.wait()
    assert events == ["lifespan.startup.complete"], events
    key = uuid.uuid4().hex.encode()
    first, replay = await _post(app, key), await _post(app, key)
    assert first[0]["status"] == replay[0]["status"] == 200, (first[0], replay[0])
    replayed = (b"x-idempotent-replay", b"true") in replay[0]["headers"]
    assert replayed == (app.user_middleware != []), replay[0]  # the guarded apps replayed it
    shutdown.set()
    await lifespan


def count(name: str, redis_url: str) -> tuple[dict[str, float], list[str]]:
    """The counts for app ``name`` in this interpreter, and the modules it loaded."""
    gc.collect()
    modules, objects = set(sys.modules), len(gc.get_objects())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    asyncio.run(serve(build(name, redis_url)))
    gc.collect()
    loaded = sorted(set(sys.modules) - modules)
    counts = {
        "modules": len(loaded),
        "gc_objects": len(gc.get_objects()) - objects,
        "rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024,
    }
    return counts, loaded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--apps", default=",".join(APPS), help="comma-separated: bare, memory, redis"
    )
    parser.add_argument("--modules", choices=APPS, help="print the modules this app loads")
    parser.add_argument("--count", choices=APPS, help=argparse.SUPPRESS)  # one app, as JSON
    args = parser.parse_args(argv)
    if args.modules or args.count:
        counts, loaded = count(args.modules or args.count, args.redis_url)
        print("\n".join(loaded) if args.modules else json.dumps(counts))
        return
    print("| app | modules | GC-tracked objects | peak RSS (MiB) |\n|---|---|---|---|")
    for name in args.apps.split(","):
        command = [sys.executable, "-m", "bench.startup", "--count", name]
        done = subprocess.run([*command, "--redis-url", args.redis_url], capture_output=True)
        if done.returncode:
            sys.exit(done.stderr.decode())
        counts = json.loads(done.stdout)
        print(
            f"| {name} | {counts['modules']} | {counts['gc_objects']} | {counts['rss_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()
