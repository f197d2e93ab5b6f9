"""The learner room: one batch in, metrics out. The algorithm record a preset resolves to
(``algorithm``), the token batch and its rows (``batch``), the value model (``critic``), what a
group teaches (``signal``), a batch's rewards as advantages (``credit``), the rollout batch made
ready once (``prepare``), the loss and the optimizer step (``update``) and the update of one batch
of episodes with its metrics (``train_batch``).

Import rule: may import ``veriloop.algos.maths``, ``veriloop.algos.run`` (the sharding helpers),
``veriloop.agents``, ``veriloop.envs`` and ``veriloop.configs``; never the loop
(``veriloop.algos.loop``), evaluation or SFT. The learner does not know where its batch came from.
"""
