"""Helpers shared by the tests. Test modules import from here, never from a ``conftest.py`` or
from another test module; the ``conftest.py`` files hold fixtures and hooks only.

- :mod:`.conditions`: :func:`~.conditions.eventually` (and ``eventually_sync``), the one way
  to wait for a condition.
- :mod:`.apps` and :mod:`.guarded`: the FastAPI and Starlette apps with the same guarded
  endpoints, one of them behind the middleware (:class:`~.guarded.GuardedApp`), and an
  in-process client (``make_client``).
- :mod:`.broken_store`: a MemoryStore made to fail or hang.
- :mod:`.records`: records to arrange a store with.
- :mod:`.stores`: every store backend behind one contract (:class:`~.stores.ClockedStore`),
  and Redis probes.
- :mod:`.postgres` and :mod:`.cutting_proxy`: PostgreSQL arrangements, and a proxy that loses
  one exchange.
- :mod:`.routing` and :mod:`.json_values`: the routing and fingerprint tests' shared pieces.
- :mod:`.uvicorn` and :mod:`.live_server`: real uvicorn servers, in a child process or a
  thread, and the client tests' server.
- :mod:`.e2e`: the demo clusters and requests of the end-to-end tests.
- :mod:`.cli`: running the command line as a user does.
- :mod:`.readme_blocks`: reading the README's and the docs' code blocks and transcripts.
- :mod:`.property`: the property suite's apps, request driver, oracle, invariants,
  scenarios and hypothesis settings.
"""
