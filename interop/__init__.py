"""Interop: veriloop environments in other frameworks, and other frameworks' environments here.

Each adapter lives in its own module and imports its framework lazily; using one without its extra
raises :class:`~veriloop.interop._extras.MissingExtraError` naming ``pip install 'veriloop[<extra>]'``.
Importing this package itself needs nothing beyond veriloop.

In (other environments as veriloop / Gymnasium envs):

* :mod:`.reasoning_gym_env` -- ``veriloop/ReasoningGym-v0``: any reasoning-gym dataset, scored by
  reasoning-gym's own scorer in a jail of its own (:mod:`veriloop.envs.verifiers.sandbox`), or by
  our own safe check where reasoning-gym's evaluates the text (``[reasoning-gym]``).
* :mod:`.openenv_client` -- an OpenEnv server's environment as a ``gymnasium.Env`` (``[openenv]``).

Out (veriloop environments elsewhere):

* :mod:`.openenv_server` -- serve any ``veriloop/*`` id as an OpenEnv environment (``[openenv]``).
* :mod:`.openenv_trace` -- an episode as an OpenEnv 0.10 ``TrainingTrace`` (``[openenv]``).
* :mod:`.trl_env` -- veriloop envs behind TRL's ``GRPOTrainer(environment_factory=...)``, one or a
  dict of several (``[trl]``).
* verifiers 0.4 (``[verifiers]``): no adapter module is needed -- its own OpenEnv taskset
  (``verifiers.v1.tasksets.openenv``, ``base_url=...``) consumes :mod:`.openenv_server`.

Not adapted: TextArena 0.7 (MIT) seeds the process-global ``random`` module on reset, which a
veriloop env must not do (seed the env, not the process); see the README's "Interop" section.
"""

from veriloop.envs._package_name import require_package_name
from veriloop.interop._extras import MissingExtraError

require_package_name(__name__, "interop")  # the folder interop/ is the package veriloop.interop

__all__ = ["MissingExtraError"]
