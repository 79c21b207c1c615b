"""kvroute's face: the ``kvroute`` command (:mod:`kvroute.cli`), above ``router``, ``policies``
and ``loadtest``, and the generator of the config's JSON Schema files (:mod:`kvroute.config_schema`)."""
