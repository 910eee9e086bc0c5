"""The auto-tuner: an Optuna search over context-parallel configurations, measured on real ranks."""

from ..workload import Workload
from .study import DEFAULT_STORAGE, get_storage
from .interrupts import SearchInterrupted
from .records import TrialRecord
from .result import SearchResult
from .run import search
from .settings import MeasureSettings, SearchSettings
from .._space import config_key
from .space import all_configs, pytorch_default

__all__ = ["DEFAULT_STORAGE", "MeasureSettings", "SearchInterrupted", "SearchResult", "SearchSettings",
           "TrialRecord", "Workload", "all_configs", "config_key", "get_storage", "pytorch_default", "search"]
