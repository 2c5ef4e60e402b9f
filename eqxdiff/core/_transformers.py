"""transformers, imported without its framework notice: eqxdiff reads only tokenizers from it (the models are its
own, in JAX), so "PyTorch was not found. Models won't be available ..." on every run without PyTorch says nothing
true of an eqxdiff run."""

import os
import sys

# transformers' own switch for its advisory notices (``logger.warning_advice``); the framework notice is one, logged
# when transformers is first imported.
ADVISORY_SWITCH = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def import_transformers():
    """The ``transformers`` module, imported (the first time) with its advisory notices off, unless the user set
    :data:`ADVISORY_SWITCH` either way. The switch is set only around the import, which is where transformers gives
    the framework notice: the environment is the user's again afterwards, and real warnings print as before. Every
    place in eqxdiff that imports transformers imports it through here."""
    if "transformers" in sys.modules or ADVISORY_SWITCH in os.environ:
        import transformers

        return transformers
    os.environ[ADVISORY_SWITCH] = "1"
    try:
        import transformers
    finally:
        os.environ.pop(ADVISORY_SWITCH, None)
    return transformers
