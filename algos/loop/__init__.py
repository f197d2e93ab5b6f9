"""The loop room: how batches reach the learner. The training entry point (``train``), the one
step body (``run_steps``) over a batch source (``source``: the interface and the synchronous
source), the asynchronous source with its generation worker and admission rule (``async_loop``,
``async_worker``, ``staleness``, ``async_eval``), the run's records and checkpointing (``parts``),
a step's metrics (``metrics``), the curriculum, environment mixtures and sampling seeds with dynamic
sampling (``curriculum``, ``mixture``, ``sampling``).

Import rule: may import every other room of ``veriloop.algos`` and the floors below
(``veriloop.agents``, ``veriloop.envs``, ``veriloop.configs``); only ``veriloop.cli`` imports it.
"""
