"""Verification of the scheduling kernel: model checking over the objects that serve.

Data flow: a :class:`scheduler.verify.scope.Scope` describes a small cluster
and workload space; :class:`scheduler.verify.model.World` is one state of that
cluster, decided by the drivers every deployment uses (one
``ClusterScheduler``, one ``WorkerScheduler`` per worker, one policy from
``scheduler.policies.make_policy``) and carried out like the workers do
(``KVBlockAccount``, ``PrefixIndex``, typed worker reports); it is moved by
events (arrive, plan, worker step, clock tick, early stop, worker failure).
After every event the hard invariants of :mod:`scheduler.invariants` (plus
block ownership, and the tier order of every selection the drivers made) are
checked.

- :func:`scheduler.verify.exhaustive.explore`: every interleaving in the scope,
  with state hashing (:mod:`scheduler.verify.snapshot`); a counterexample
  trace per violated invariant.
- :func:`scheduler.verify.trajectories.run_trajectories`: statistical model
  checking over random workloads (multiprocessing for large counts); the soft
  invariant (tier-0 P99 TTFT within target) as a rate with a Wilson 95 % CI.
- ``tierserve check`` (:mod:`scheduler.verify.cli`) runs either and writes JSON.

Both take a ``policy_factory`` (and ``account_factory``) so tests can inject a
faulty policy or faulty accounting (:mod:`scheduler.verify.faults`) and see the
checker fail.
"""
