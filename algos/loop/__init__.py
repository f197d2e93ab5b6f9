"""The loop room: how batches reach the learner. The training entry point and its step (``train``,
``step``), the asynchronous generation worker and its admission rule (``async_loop``,
``async_worker``, ``staleness``, ``async_eval``), the curriculum, environment mixtures and dynamic
sampling (``curriculum``, ``mixture``, ``sampling``).

Import rule: may import every other room of ``veriloop.algos`` and the floors below
(``veriloop.agents``, ``veriloop.envs``, ``veriloop.configs``); only ``veriloop.cli`` imports it.
"""
