"""The configurations a benchmark run compares, and what each one needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["bare", "floor", "ours", "peer"]
Service = Literal["redis", "postgres"]
AppName = Literal["plain", "payments"]
# ``plain``: today's service (snake_case body, int amount, ~300-byte answer). ``payments``: the
# shape of a user's app in issue #17 (camelCase four-field model, float amount, a small dict).
APPS: tuple[AppName, ...] = ("plain", "payments")


@dataclass(frozen=True, slots=True)
class Config:
    """One server setup: the same FastAPI endpoint behind a different idempotency layer.

    A *variant* (``variant_of``) is wired as the configuration it names, with
    ``protect_all=True`` instead of ``@idempotent`` on the route, or with ``prefill`` live
    records put in the store before the load starts.
    """

    name: str
    kind: Kind
    description: str
    needs: tuple[Service, ...] = ()
    variant_of: str | None = None
    protect_all: bool = False
    prefill: int = 0
    apps: tuple[AppName, ...] = APPS

    @property
    def wiring(self) -> str:
        """The configuration whose layer this one builds (itself unless a variant)."""
        return self.variant_of or self.name


CONFIGS: tuple[Config, ...] = (
    Config("bare", "bare", "no middleware (the endpoint alone)"),
    Config(
        "floor-redis",
        "floor",
        "hand-written pure ASGI middleware: SET NX PX GET before, SET EX after",
        ("redis",),
    ),
    Config(
        "floor-memory",
        "floor",
        "the floor's middleware over a dict in the process (SET NX GET semantics, no expiry)",
    ),
    Config("ours-memory", "ours", "IdempotencyMiddleware + MemoryStore"),
    Config(
        "ours-memory-all",
        "ours",
        "IdempotencyMiddleware(protect_all=True) + MemoryStore, no decorator",
        variant_of="ours-memory",
        protect_all=True,
        apps=("payments",),
    ),
    Config(
        "ours-memory-500k",
        "ours",
        "IdempotencyMiddleware + MemoryStore holding 500,000 live records when the load starts",
        variant_of="ours-memory",
        prefill=500_000,
        apps=("payments",),
    ),
    Config(
        "ours-redis-setnx",
        "ours",
        "IdempotencyMiddleware + RedisStore(acquire='setnx')",
        ("redis",),
    ),
    Config(
        "ours-redis-setnx-all",
        "ours",
        "IdempotencyMiddleware(protect_all=True) + RedisStore(acquire='setnx'), no decorator",
        ("redis",),
        variant_of="ours-redis-setnx",
        protect_all=True,
        apps=("payments",),
    ),
    Config(
        "ours-redis-lua", "ours", "IdempotencyMiddleware + RedisStore(acquire='lua')", ("redis",)
    ),
    Config(
        "ours-redis-glide",
        "ours",
        "IdempotencyMiddleware + RedisStore(driver='glide'), valkey-glide instead of redis-py",
        ("redis",),
    ),
    Config(
        "ours-redis-glide-all",
        "ours",
        "IdempotencyMiddleware(protect_all=True) + RedisStore(driver='glide'), no decorator",
        ("redis",),
        variant_of="ours-redis-glide",
        protect_all=True,
        apps=("payments",),
    ),
    Config("ours-postgres", "ours", "IdempotencyMiddleware + PostgresStore", ("postgres",)),
    Config("aih-memory", "peer", "asgi-idempotency-header + MemoryBackend"),
    Config("aih-redis", "peer", "asgi-idempotency-header + RedisBackend", ("redis",)),
    Config("mobius-memory", "peer", "mobius-idempotence-library @idempotent + MemoryBackend"),
    Config(
        "mobius-redis",
        "peer",
        "mobius-idempotence-library @idempotent + RedisBackend (Lua)",
        ("redis",),
    ),
)

BY_NAME: dict[str, Config] = {config.name: config for config in CONFIGS}

# Whose throughput the targets compare against which floor.
FLOOR_FOR: dict[str, str] = {
    "ours-redis-setnx": "floor-redis",
    "ours-redis-lua": "floor-redis",
    "ours-redis-glide": "floor-redis",
    "ours-redis-setnx-all": "floor-redis",
    "ours-redis-glide-all": "floor-redis",
}


def floor_of(name: str) -> str | None:
    """The floor a configuration of ours or a peer compares against: ``floor-redis`` for a Redis
    store, ``floor-memory`` for an in-process one (none for a server-backed store without one)."""
    config = BY_NAME.get(name)
    if config is None or config.kind not in ("ours", "peer"):
        return None
    if "redis" in config.needs:
        return "floor-redis"
    return None if config.needs else "floor-memory"


def select(names: str | None) -> tuple[Config, ...]:
    """The configurations named in a comma-separated list (all when ``None``), in run order."""
    if not names:
        return CONFIGS
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(BY_NAME)}")
    return tuple(config for config in CONFIGS if config.name in wanted)


def for_app(configs: tuple[Config, ...], app: AppName) -> tuple[Config, ...]:
    """The configurations of ``configs`` that run in ``app`` (variants run in one app only)."""
    return tuple(config for config in configs if app in config.apps)


def select_apps(name: str) -> tuple[AppName, ...]:
    """``plain``, ``payments`` or ``both`` (both apps, ``plain`` first)."""
    if name == "both":
        return APPS
    for app in APPS:
        if app == name:
            return (app,)
    raise ValueError(f"unknown app {name!r}; known: {', '.join(APPS)}, both")
