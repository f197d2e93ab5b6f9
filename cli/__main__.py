"""``python -m veriloop.cli`` (e.g. under ``accelerate launch -m veriloop.cli train CONFIG``)."""

import sys

from veriloop.cli.main import run

sys.exit(run())
