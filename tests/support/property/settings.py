"""Hypothesis profiles for the property suite, chosen with ``HYPOTHESIS_PROFILE``.

``property`` (the default) is derandomized and database-free, so CI runs the same examples
every time and stays fast; ``fuzz`` (``./task test:fuzz``) draws many more, freshly seeded, and
keeps failures in the local example database to replay them on the next run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_RELAXED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile(
    "property",
    max_examples=40,
    # Explaining a failure re-runs it a hundred times; the shrunk scenario says enough.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    # Shrink one failure per test, not each distinct one: a broken tree stays quick to test.
    report_multiple_bugs=False,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=_RELAXED,
)
settings.register_profile(
    "fuzz",
    max_examples=1000,
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=_RELAXED,
)

#: The settings every property test runs with: the profile ``HYPOTHESIS_PROFILE`` names when it
#: is one of ours, else ``property`` (another value may belong to another suite).
PROPERTY_SETTINGS = settings.get_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "property")
    if os.environ.get("HYPOTHESIS_PROFILE") in ("property", "fuzz")
    else "property"
)
