"""kvroute's face: the ``kvroute`` command (:mod:`kvroute.cli`), above ``router``, ``policies``
and ``loadtest``."""
