"""``cptune.cli``: the ``cptune`` command (:func:`main`, ``cptune.cli:main``) and what the shipped training scripts take
from it: the click types every option takes, each calling the library's rule (:mod:`._types`), and
:func:`script_check`, the script's own checks that ``cptune launch`` runs once before torchrun starts a rank
(:mod:`._preflight`). The commands (:mod:`._commands`, :mod:`._search`, :mod:`._plan`), what they print
(:mod:`._console`), ``cptune check`` (:mod:`._recipe_check`) and the shipped recipes (:mod:`._catalog`) are its own.
"""

from ._commands import main
from ._preflight import script_check
from ._types import COUNT, DOCUMENTS, FINITE_RATE, FOLDER, KEY_VALUE, RECIPE, VIDEO, InputFile, OneOf, OutputFile, \
    Script, Whole

__all__ = ["COUNT", "DOCUMENTS", "FINITE_RATE", "FOLDER", "InputFile", "KEY_VALUE", "OneOf", "OutputFile", "RECIPE",
           "Script", "VIDEO", "Whole", "main", "script_check"]
