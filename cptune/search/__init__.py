"""The auto-tuner: an Optuna search over context-parallel configurations, measured on real ranks."""

from .driver import DEFAULT_STORAGE, get_storage
from .interrupts import SearchInterrupted
from .run import search
from .measure import MeasureSettings
from .result import SearchResult, TrialRecord
from .space import all_configs, config_key, pytorch_default
from .workload import Workload

__all__ = ["DEFAULT_STORAGE", "MeasureSettings", "SearchInterrupted", "SearchResult", "TrialRecord", "Workload",
           "all_configs", "config_key", "get_storage", "pytorch_default", "search"]
