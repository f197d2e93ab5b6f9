"""The old name of :mod:`veriloop.agents.models.text` (the default text model), kept because user
code imports it: ``import veriloop.agents.default_model`` gives that same module object."""

import sys

from veriloop.agents.models import text as _text

sys.modules[__name__] = _text
