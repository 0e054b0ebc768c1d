"""The configurations a benchmark run compares, and what each one needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["bare", "floor", "ours", "peer"]
Service = Literal["redis", "postgres"]


@dataclass(frozen=True, slots=True)
class Config:
    """One server setup: the same FastAPI endpoint behind a different idempotency layer."""

    name: str
    kind: Kind
    description: str
    needs: tuple[Service, ...] = ()


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
        "ours-redis-setnx",
        "ours",
        "IdempotencyMiddleware + RedisStore(acquire='setnx')",
        ("redis",),
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

# The configurations that keep their records in Redis (round trips and record sizes).
REDIS_CONFIGS: tuple[str, ...] = tuple(c.name for c in CONFIGS if "redis" in c.needs)
# Whose throughput the targets compare against which floor.
FLOOR_FOR: dict[str, str] = {
    "ours-redis-setnx": "floor-redis",
    "ours-redis-lua": "floor-redis",
    "ours-redis-glide": "floor-redis",
}


def select(names: str | None) -> tuple[Config, ...]:
    """The configurations named in a comma-separated list (all when ``None``), in run order."""
    if not names:
        return CONFIGS
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(BY_NAME)}")
    return tuple(config for config in CONFIGS if config.name in wanted)
