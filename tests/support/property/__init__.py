"""The property suite's model (``tests/property``): the guarded apps it drives, how requests
are sent, the oracle and invariants they are checked against, the scenarios hypothesis draws,
and the hypothesis settings."""
