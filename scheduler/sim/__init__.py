"""The trace-driven discrete-event simulator (see :mod:`scheduler.sim.simulator`)."""
