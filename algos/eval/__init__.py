"""The evaluation room: the loop that plays named splits (``loop``), the pass@k / avg@n / maj@k
metrics (``metrics``) and the report it writes.

Import rule: may import ``veriloop.algos.maths``, ``veriloop.algos.run``, ``veriloop.agents``,
``veriloop.envs`` and ``veriloop.configs``; never the RL loop (``veriloop.algos.loop.train``), the SFT
room or ``veriloop.cli`` (a caller that needs a policy built passes it in).
"""
