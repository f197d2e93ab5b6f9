"""The models room: the code that *builds* (trains once and caches) the default text model
(``text``) and the default vision model (``vision``, ``vision_build``, ``card_reading``).

Import rule: may import the rest of ``veriloop.agents``, ``veriloop.envs`` and ``veriloop.configs``;
the rollout path (engine, backends, loading) reaches this room only through function-local imports
made when a default model is first asked for, so playing an episode never loads the build code.
"""
