"""PostgresStore's connections: where a pool connects, how one is opened, and what a driver's
failure on one says about the statement sent on it (never ran, so it may be sent again; or may
have run, so it must not). The store (``postgres.py``) asks these questions; the answers depend
on asyncpg and on PostgreSQL's behaviour, not on the store's statements.
"""

from __future__ import annotations

import getpass
import os
import re
import select
from collections.abc import Mapping
from typing import Any, NoReturn, Protocol
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError

_HOST_PORT = re.compile(r"(.+):(\d+)")
#: What messages show of a DSN that is not a readable URL: its parts could be anything.
_UNREADABLE_DSN = "(a DSN that is not a postgresql:// URL)"
#: One host of a URL's address: a name or IPv4 address, or an IPv6 one in brackets, and a port.
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.%\w]*\]|[^:\[\]]*)(:\d*)?")

# FATAL errors that a backend raises only from an interrupt check: pg_terminate_backend and a
# smart or fast shutdown (57P01 admin_shutdown), idle_session_timeout (57P05). See never_ran
# for why they prove that a statement had no effect.
_TERMINATED_SQLSTATES = frozenset({"57P01", "57P05"})
# asyncpg refusing to send on a connection it already knows to be closed.
_CLOSED_MESSAGES = ("connection is closed", "connection has been released back to the pool")
# asyncpg's protocol refusing to start a statement while it is not idle: raised by its state
# machine (CoreProtocol._set_state) in each method that sends, before it writes a Bind, an
# Execute or a query (a Parse, which runs nothing, may have gone first). Its twin 'cannot
# switch to "idle" state' comes while a reply is read, after the statement went out: left out.
_REFUSED_TO_SEND = "cannot switch to state "


class PoolLike(Protocol):
    """The part of ``asyncpg.Pool`` the store uses."""

    async def fetchrow(self, query: str, *args: Any) -> Any: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...

    def acquire(self) -> Any: ...

    async def expire_connections(self) -> None: ...


def asyncpg_driver() -> Any:
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - the test environment has asyncpg
        raise ImportError(
            "PostgresStore needs asyncpg: pip install 'starlette-idempotency[postgres]'"
        ) from exc
    return asyncpg


def raise_store_error(exc: Exception, operation: str) -> NoReturn:
    """Re-raise a driver or network error as a :class:`StoreError`; anything else as it is."""
    asyncpg = asyncpg_driver()
    message = f"PostgreSQL {operation} failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError | asyncpg.QueryCanceledError):
        raise StoreTimeoutError(message) from exc
    if isinstance(exc, asyncpg.ClientConfigurationError):
        raise ConfigurationError(message) from exc
    if isinstance(
        exc, OSError | asyncpg.PostgresError | asyncpg.InterfaceError | asyncpg.InternalClientError
    ):
        raise StoreError(message) from exc
    raise exc


def never_ran(exc: BaseException) -> bool:
    """Whether ``exc`` proves that a single-statement operation had no effect, so that sending
    it again cannot run it twice.

    Certain: the store found the pooled connection ended before it sent anything
    (:class:`EndedWhileIdle`); asyncpg refused to send on a connection it knew was closed
    (``InterfaceError``), or to start a statement while its protocol was not idle
    (``InternalClientError``, see ``_REFUSED_TO_SEND``). An idle pooled connection is in that
    state once the event loop has read the server's termination notice but not yet the end of
    the connection (the backend still exiting): the notice came unasked, and the protocol
    waits for a ReadyForQuery that never comes. What would commit the statement (its Execute,
    or the COMMIT of the explicit transaction it ran in) never went out, and asyncpg aborts
    the connection. Or the server's termination notice, a FATAL ErrorResponse with a SQLSTATE of
    ``_TERMINATED_SQLSTATES``, came back before the statement's ReadyForQuery (asyncpg then
    raises ``ConnectionDoesNotExistError`` caused by it). A backend raises those only at an
    interrupt check, and there is none between the commit of our implicit transaction (at
    Sync, with interrupts held) and the flush of ReadyForQuery, so the statement either never
    started (the backend was idle when told to exit) or was rolled back with the backend.

    Unknown, never retried: a connection that died with no such notice after the statement
    was sent (a reset or EOF: a crashed or killed backend, a network failure, ``pg_ctl stop
    -m immediate``, whose 57P01 is only a WARNING). The commit may have happened and only its
    reply have been lost.
    """
    if isinstance(exc, EndedWhileIdle):
        return True
    asyncpg = asyncpg_driver()
    if isinstance(exc, asyncpg.InterfaceError):
        return str(exc).endswith(_CLOSED_MESSAGES)
    if isinstance(exc, asyncpg.InternalClientError):
        return str(exc).startswith(_REFUSED_TO_SEND)
    notice = exc.__cause__ if isinstance(exc, asyncpg.ConnectionDoesNotExistError) else exc
    return (
        isinstance(notice, asyncpg.PostgresError)
        and getattr(notice, "sqlstate", None) in _TERMINATED_SQLSTATES
    )


class EndedWhileIdle(ConnectionResetError):
    """A pooled connection the server had ended while it sat idle, found before anything was
    sent on it (see :func:`ended_while_idle`)."""


def ended_while_idle(connection: Any) -> bool:
    """Whether this idle connection has ended: asyncpg closed it, its socket is closed, or the
    server has sent something to it. A connection checked out of the pool owes no reply, so
    what waits to be read there is the server ending it (an immediate shutdown, a crash, a
    failover, an idle timeout, with or without a notice first) that the event loop has not
    read yet, because it was busy. Sent on, a statement would meet a connection already
    closed, with no word proving it did not run. A socket the check cannot see counts as
    alive.

    A notice the loop has read, the end not yet, shows in no state asyncpg exposes: the
    statement is then refused before anything goes out (see :func:`never_ran`)."""
    if connection.is_closed():
        return True
    transport = getattr(connection, "_transport", None)
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return False
    if sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def may_have_run(exc: BaseException | None) -> bool:
    """Whether the statement that failed with ``exc`` may still have committed: it was
    abandoned when the operation timed out, or lost its connection with no word from the
    server. An error the statement itself raised (a server-side ``statement_timeout``
    included), or one before it was sent (no connection), left nothing behind."""
    if isinstance(exc, TimeoutError):
        return True
    asyncpg = asyncpg_driver()
    return isinstance(exc, asyncpg.ConnectionDoesNotExistError) and not never_ran(exc)


def _readable(parts: SplitResult) -> bool:
    """Whether a DSN split into ``parts`` is a ``postgresql://`` URL whose address is where
    urlsplit found it: an unescaped ``/``, ``?`` or ``#`` in a password ends the address
    early, leaving part of the password as a port and the rest, ``@host`` and all, after."""
    if parts.scheme not in ("postgres", "postgresql"):
        return False
    if "@" in parts.path or "@" in parts.query or "@" in parts.fragment:
        return False
    address = parts.netloc.rpartition("@")[2]
    return all(_ADDRESS.fullmatch(host) is not None for host in address.split(","))


def location_of(dsn: str | None, options: Mapping[str, Any]) -> str:
    """``host:port/database`` for messages, as the connect options, then the ``dsn`` URL,
    then the libpq environment give them; never the user or password."""
    fields: dict[str, str] = {}
    if dsn:
        try:
            parts = urlsplit(dsn)
        except ValueError:  # brackets urlsplit reads as an IPv6 address, in a password say
            return _UNREADABLE_DSN
        if not _readable(parts):
            return _UNREADABLE_DSN
        fields.update(parse_qsl(parts.query))
        if hosts := unquote(parts.netloc.rpartition("@")[2]):
            fields["host"] = hosts
        if parts.path.strip("/"):
            fields["dbname"] = unquote(parts.path.strip("/"))
        if parts.username:
            fields["user"] = unquote(parts.username)

    def pick(option: str, keyword: str, variable: str, default: str) -> str:
        value = options.get(option) or fields.get(keyword) or os.environ.get(variable)
        return str(value or default)

    host = pick("host", "host", "PGHOST", "localhost")
    port = pick("port", "port", "PGPORT", "5432")
    user = pick("user", "user", "PGUSER", getpass.getuser())
    database = pick("database", "dbname", "PGDATABASE", user)
    if "," not in host and _HOST_PORT.fullmatch(host) is None:
        host = f"{host}:{port}"
    return f"{host}/{database}"


def connect_options(pool: object) -> tuple[str | None, Mapping[str, Any]] | None:
    """The DSN and connect options of an asyncpg pool (asyncpg keeps them, privately);
    ``None`` for a pool whose options cannot be read back."""
    args, options = getattr(pool, "_connect_args", None), getattr(pool, "_connect_kwargs", None)
    if not isinstance(args, tuple | list) or not isinstance(options, Mapping):
        return None
    return (args[0] if args and isinstance(args[0], str) else None), options


def pool_location(pool: object) -> str:
    """Where an asyncpg pool connects."""
    connect = connect_options(pool)
    return "an unknown address (a pool passed in)" if connect is None else location_of(*connect)


def is_open(pool: object) -> bool:
    """Whether ``pool`` is open, as far as it says (asyncpg's ``is_closing``)."""
    is_closing = getattr(pool, "is_closing", None)
    return not (callable(is_closing) and is_closing())


async def keep_session(connection: Any) -> None:
    """A pool ``reset`` that sends nothing (see ``PostgresStore.from_dsn``)."""


async def create_pool(dsn: str | None, options: Mapping[str, Any]) -> Any:
    """An asyncpg pool, opened in the running event loop; options asyncpg refuses are a
    :class:`ConfigurationError`, and a database it cannot reach a :class:`StoreError`."""
    asyncpg = asyncpg_driver()
    try:
        return await asyncpg.create_pool(dsn, **options)
    except asyncpg.ClientConfigurationError as exc:
        raise_store_error(exc, "connect")
    except (TypeError, ValueError) as exc:  # an option asyncpg does not take, or a bad value
        raise ConfigurationError(f"PostgresStore pool options: {exc}") from exc
    except Exception as exc:
        raise_store_error(exc, "connect")
