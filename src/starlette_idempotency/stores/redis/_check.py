"""What :meth:`RedisStore.check` reports: reachability, eviction and persistence settings."""

from __future__ import annotations

import asyncio

from starlette_idempotency.stores.base import StoreFinding
from starlette_idempotency.stores.redis._driver import RedisDriver

#: How long :meth:`RedisStore.check` waits for PING, then for the settings: both together
#: within the 5 s the middleware gives the whole check.
CHECK_TIMEOUT_SECONDS = 2.0
_CHECKED_SETTINGS = ("maxmemory", "maxmemory-policy", "appendonly", "save")
_APPENDONLY_ADVICE = (
    "set appendonly yes (with appendfsync everysec, a crash of the host loses about the last "
    "second of writes)"
)


async def check_redis(driver: RedisDriver, where: str) -> list[StoreFinding]:
    """Reach Redis through ``driver`` and report what weakens idempotency; never raises."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_SECONDS):
            await driver.ping()
    except TimeoutError:
        why = f"no answer to PING within {CHECK_TIMEOUT_SECONDS:g} s"
        return [StoreFinding("error", f"{where} is unreachable: {why}")]
    except Exception as exc:  # a check reports what went wrong, whatever it is
        return [StoreFinding("error", f"{where} is unreachable: {str(exc).strip()}")]
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_SECONDS):
            settings = {name: await driver.config_get(name) for name in _CHECKED_SETTINGS}
    except Exception as exc:  # renamed, refused by an ACL, or gone since the PING
        return [
            StoreFinding(
                "warning",
                f"could not read the configuration of {where} "
                f"({str(exc).strip() or 'no answer'}), so "
                "eviction and persistence are unchecked. Check by hand that maxmemory-policy "
                "is noeviction (or maxmemory 0), and that appendonly is yes.",
            )
        ]
    return _settings_findings(where, settings)


def _settings_findings(where: str, settings: dict[str, dict[str, str]]) -> list[StoreFinding]:
    """What weakens the store in ``settings`` (setting -> node -> value), one finding per kind,
    naming the nodes of a cluster that have it."""
    nodes = sorted(settings["maxmemory"])
    evicting: dict[str, list[str]] = {}
    persisting: dict[str, list[str]] = {}
    for node in nodes:
        value = {name: settings[name].get(node, "") for name in _CHECKED_SETTINGS}
        policy = value["maxmemory-policy"]
        if value["maxmemory"] not in ("", "0") and policy != "noeviction":
            setting = f"maxmemory {value['maxmemory']} bytes with maxmemory-policy {policy}"
            evicting.setdefault(setting, []).append(node)
        if value["appendonly"] != "yes":
            persisting.setdefault(value["save"], []).append(node)

    def on(found: list[str]) -> str:
        return f" (on {', '.join(found)})" if len(nodes) > 1 else ""

    findings = [
        StoreFinding(
            "warning",
            f"{where} can evict idempotency records{on(found)}: {setting}. Every record has "
            "a TTL, so volatile-* policies evict them too, and a retry of an evicted key runs "
            "its handler again. Set maxmemory-policy noeviction (a full Redis then refuses "
            "writes, which the middleware handles as a store error); if this Redis is a cache "
            "that must evict, give idempotency an instance of its own with noeviction.",
        )
        for setting, found in evicting.items()
    ]
    for save, found in persisting.items():
        if save.strip():
            lost = f"the records written since the last RDB snapshot (save {save!r})"
        else:
            lost = "every record (appendonly no, save '')"
        findings.append(
            StoreFinding(
                "warning",
                f"{where} runs without an append-only file{on(found)}: a restart loses {lost}, "
                f"and retries of requests already answered then run again; {_APPENDONLY_ADVICE}.",
            )
        )
    return findings
