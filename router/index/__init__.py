"""The prefix index: which backends are believed to hold which block chains.

:func:`router.index.build.build_index` builds the one index a config asks for. It is not
re-exported here: it imports the config, and the config imports this package's settings
(``router.index.settings``), so importing it here would make the config's import a circle.
"""

from router.index.base import Candidate, PrefixIndex
from router.index.memory import MemoryIndex

__all__ = ["Candidate", "MemoryIndex", "PrefixIndex"]
