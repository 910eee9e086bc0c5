"""The auto-tuner: an Optuna search over context-parallel configurations, measured on real ranks.

:func:`cptune.tune` (``cptune.search.search``) runs one; the rest is what a search is configured with and
gives back. Calling the subpackage itself, ``cptune.search(...)``, is 0.1's spelling of :func:`cptune.tune`: it
still runs the search, for one release, with a DeprecationWarning.
"""

import sys
import types
import warnings

from ..workload import Workload
from .study import DEFAULT_STORAGE, get_storage
from .interrupts import SearchInterrupted
from .records import TrialRecord
from .result import SearchResult
from .run import search
from .settings import MeasureSettings, SearchSettings
from ..plan import config_key
from .space import all_configs, pytorch_default

__all__ = ["DEFAULT_STORAGE", "MeasureSettings", "SearchInterrupted", "SearchResult", "SearchSettings",
           "TrialRecord", "Workload", "all_configs", "config_key", "get_storage", "pytorch_default", "search"]


class _Deprecated(types.ModuleType):
    """``cptune.search`` is this subpackage; calling it as the function it once was still works, for one release."""

    def __call__(self, *args, **kwargs):
        warnings.warn("cptune.search(...) is deprecated and goes in the next release: call cptune.tune(...), the "
                      "same function (cptune.search is the subpackage: cptune.search.MeasureSettings and the rest)",
                      DeprecationWarning, stacklevel=2)
        return search(*args, **kwargs)


sys.modules[__name__].__class__ = _Deprecated
