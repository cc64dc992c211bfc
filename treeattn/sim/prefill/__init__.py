"""Sharded prefill, priced: the causal layout the runtime's ring shares
(:mod:`~treeattn.sim.prefill.layout`) and the time to first token of each prefill algorithm
(:mod:`~treeattn.sim.prefill.pricing`)."""
