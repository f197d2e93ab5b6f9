"""The run room: everything a run needs around the maths -- checkpoints (whole and sharded), the
metrics log, progress lines, the step loop and its non-finite guard, the run-folder lock,
data-parallel and FSDP plumbing, and plots.

Import rule: may import ``veriloop.agents``, ``veriloop.envs``, ``veriloop.configs`` and
``veriloop.algos.maths`` and ``veriloop.algos.learner.batch``/``critic`` (the records it saves or shards);
never the RL loop, the SFT or evaluation rooms, or ``veriloop.cli``.
"""
