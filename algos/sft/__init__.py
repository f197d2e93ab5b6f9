"""The SFT warm-up room: supervised examples built from an env's solver or a file (``data``), the
masked next-token loss (``loss``), the image-bearing variant (``vision``) and the warm-up loop
(``train``).

Import rule: may import ``veriloop.algos.maths``, ``veriloop.algos.run``, the top-level batch
helpers (``veriloop.algos.learner.batch``), ``veriloop.agents``, ``veriloop.envs`` and ``veriloop.configs``;
never the RL loop (``veriloop.algos.loop.train``), evaluation or ``veriloop.cli``.
"""
