"""The configurations a benchmark run compares, and what each one needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["bare", "floor", "ours", "peer"]
Service = Literal["redis", "postgres"]


@dataclass(frozen=True, slots=True)
class Config:
    """One server setup: the same FastAPI endpoint behind a different idempotency layer.

    A *variant* (``variant_of``) is wired as the configuration it names, with
    ``protect_all=True`` instead of ``@idempotent`` on the route. ``freeze_heap``: the app
    calls ``gc.freeze()`` once started, as an application may (the library never does).
    ``module`` is the peer library's import name (a peer that is not installed is skipped,
    saying so).
    """

    name: str
    kind: Kind
    description: str
    needs: tuple[Service, ...] = ()
    variant_of: str | None = None
    protect_all: bool = False
    freeze_heap: bool = False
    module: str | None = None

    @property
    def wiring(self) -> str:
        """The configuration whose layer this one builds (itself unless a variant)."""
        return self.variant_of or self.name

    @property
    def store(self) -> str:
        """``memory``, ``redis`` or ``postgres``: which peers and floor it compares with."""
        return self.needs[0] if self.needs else "memory"


_REDIS: tuple[Service, ...] = ("redis",)


def _peer(name: str, description: str, module: str) -> Config:
    needs = _REDIS if name.endswith("-redis") else ()
    return Config(name, "peer", description, needs, module=module)


CONFIGS: tuple[Config, ...] = (
    Config("bare", "bare", "no middleware (the endpoint alone)"),
    Config("floor-redis", "floor", "hand-written ASGI: SET NX PX GET before, SET EX after", _REDIS),
    Config("floor-memory", "floor", "the floor's middleware over a dict in the process"),
    Config(
        "floor-memory-checked",
        "floor",
        "floor-memory that also reads the body and answers 422 to another body (raw SHA-256)",
    ),
    Config("ours-memory", "ours", "IdempotencyMiddleware + MemoryStore, @idempotent route"),
    Config(
        "ours-memory-all",
        "ours",
        "IdempotencyMiddleware(protect_all=True) + MemoryStore, no decorator",
        variant_of="ours-memory",
        protect_all=True,
    ),
    Config("ours-redis", "ours", "IdempotencyMiddleware + RedisStore (redis-py, SET NX)", _REDIS),
    Config(
        "ours-redis-all",
        "ours",
        "IdempotencyMiddleware(protect_all=True) + RedisStore (redis-py), no decorator",
        _REDIS,
        variant_of="ours-redis",
        protect_all=True,
    ),
    Config(
        "ours-redis-all-frozen",
        "ours",
        "ours-redis-all in an app that calls gc.freeze() once started",
        _REDIS,
        variant_of="ours-redis",
        protect_all=True,
        freeze_heap=True,
    ),
    Config("ours-redis-lua", "ours", "IdempotencyMiddleware + RedisStore(acquire='lua')", _REDIS),
    Config(
        "ours-redis-glide", "ours", "IdempotencyMiddleware + RedisStore(driver='glide')", _REDIS
    ),
    Config("ours-postgres", "ours", "IdempotencyMiddleware + PostgresStore", ("postgres",)),
    _peer("aih-memory", "asgi-idempotency-header + MemoryBackend", "idempotency_header_middleware"),
    _peer("aih-redis", "asgi-idempotency-header + RedisBackend", "idempotency_header_middleware"),
    _peer("mobius-memory", "mobius @idempotent + MemoryBackend", "mobius_idempotence"),
    _peer("mobius-redis", "mobius @idempotent + RedisBackend (Lua)", "mobius_idempotence"),
    _peer("idemkit-memory", "idemkit IdempotencyMiddleware + InMemoryBackend", "idemkit"),
    _peer("idemkit-redis", "idemkit IdempotencyMiddleware + RedisBackend (Lua)", "idemkit"),
    _peer("idemgate-redis", "idemgate IdempotencyRoute + @idempotent + RedisAcquirer", "idemgate"),
)

BY_NAME: dict[str, Config] = {config.name: config for config in CONFIGS}


def floor_of(name: str) -> str | None:
    """The floor a configuration of ours or a peer compares against (none for PostgreSQL)."""
    config = BY_NAME[name]
    if config.kind not in ("ours", "peer") or config.store == "postgres":
        return None
    return f"floor-{config.store}"


def select(names: str | None) -> tuple[Config, ...]:
    """The configurations named in a comma-separated list (all when ``None``), in run order."""
    if not names:
        return CONFIGS
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(BY_NAME)}")
    return tuple(config for config in CONFIGS if config.name in wanted)


def installed(configs: tuple[Config, ...]) -> tuple[tuple[Config, ...], list[str]]:
    """Drop the peer configurations whose library cannot be imported, saying why."""
    kept, skipped = [], []
    for config in configs:
        if config.module is not None:
            try:
                __import__(config.module)
            except ImportError as exc:
                skipped.append(f"{config.name} skipped: {exc} (task bench installs the peers)")
                continue
        kept.append(config)
    return tuple(kept), skipped
