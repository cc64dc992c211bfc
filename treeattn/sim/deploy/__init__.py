"""The whole deployment, beyond one attention layer.

:mod:`~treeattn.sim.deploy.capacity` (the whole model's memory per GPU),
:mod:`~treeattn.sim.deploy.token` (one decode step per output token),
:mod:`~treeattn.sim.deploy.deployments` (the TP x DCP x CP search by time per output token)
and :mod:`~treeattn.sim.deploy.engines` (the serving engines' flags for a plan).
"""
