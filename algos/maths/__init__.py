"""The maths room: advantage estimators, policy and value losses, reward shaping, off-policy
correction and the rollout/trainer mismatch measures, as pure functions of tensors.

Import rule: torch, the standard library and ``veriloop.configs`` (its ``Literal`` names) only, plus
the verifiers' pure format checks in ``veriloop.envs.verifiers``. No model code (nothing from
``veriloop.agents``, no ``transformers``), no file or network I/O, nothing from the rest of
``veriloop.algos``: every other room may import this one, this one imports none of them.
"""
