"""tierserve's scheduling kernel: plain Python decisions over snapshots.

No Ray, torch or asyncio here: every decision is a function of a snapshot that
returns a plan, and whoever owns the mechanism (the global scheduler actor, a
worker's step loop, the simulator) applies it. Public API, by module:

- ``scheduler.request``: ``Request``, ``RequestState``, ``transition(req, to, *,
  decision, triggered_by, now, ...) -> DecisionRecord`` (refuses illegal moves
  with ``IllegalTransition``), ``ALLOWED_TRANSITIONS``, ``Decision``.
- ``scheduler.tiers``: ``TierConfig``/``TierSpec`` (validated, ``ConfigError``
  names the field), ``default_tiers()``, ``ShareMode``, ``TierMix``.
- ``scheduler.deadlines``: ``ServiceEstimate`` (protocol: ``prefill_s(new,
  cached)``, ``decode_token_s()``), ``deadline``, ``remaining_work_s``,
  ``slack_s``, ``DeadlineWatcher`` (``tick(now, reqs)`` every control interval).
- ``scheduler.ordering``: ``make_ordering(name, tiers, est)`` with names
  ``utility``, ``slack`` (default), ``wfq``; ``policy.order(reqs, now) ->
  list[Request]`` (run in that order until the step budget is full);
  ``UnknownPolicy`` lists the valid names.
- ``scheduler.fairshare``: ``FairShareController.update(now, tail_ratios) ->
  shares | None`` (every 100 ms, at most 10 pp per tier per update, sums to 1,
  fixed in quota mode); ``ShareLedger`` (demand/served tokens, deficit tiers);
  ``TailTracker``.
- ``scheduler.admission``: ``AdmissionController.decide(req, now, LoadSnapshot)
  -> AdmissionDecision(kind ACCEPT|QUEUE|REJECT, reason, predicted_s,
  retry_after_s)``; ``should_preempt_now(need, free, one_round, threshold)``.
- ``scheduler.placement``: ``choose_prefill(prompt_len, block_size,
  [PrefillView], est)`` (prefix match + load), ``choose_decode(need_blocks,
  [DecodeView], prefill_info, costs)`` (KV headroom, same NVLink domain first)
  -> ``DecodeChoice(view, move_class, move_s)``.
- ``scheduler.preemption``: ``choose_victims(need_blocks, [VictimView], *,
  requester_tier, now, tiers, costs, est, scorer)`` -> ``PreemptionPlan(victims
  (req_id, mode SWAP|RECOMPUTE|MIGRATE, num_blocks, cost), num_freed)``;
  scorers ``VictimScorer.TOPOLOGY`` (default) and ``DESIGN_NOTES``; greedy
  knapsack (reason in the module); anti-thrash window from the tier config.
- ``scheduler.queues``: a worker's wait queue in policy order, touched only as
  far as a step needs (``policy.make_queue()``; ``queue.push(req, now)``,
  ``queue.take(now, accept)`` with ``accept(req) -> Verdict.TAKE|SKIP|STOP``).
- ``scheduler.prefix_index``: ``PrefixIndex`` (one worker's cache: ``acquire``,
  ``release``, reuse-aware ``evict``, ``hit_rate``), ``PrefixMirror`` (global
  view fed by ``BlockStored``/``BlockRemoved`` events; ``match_lens``).
- ``scheduler.kv``: ``KVBlockAccount`` (per-worker blocks: owned, cached, free;
  all-or-nothing ``allocate``).
- ``scheduler.topology``: ``WorkerInfo``, ``TopologyClass``, ``topology_class``,
  ``LinkCosts`` (``move_s(blocks, class)``, ``swap_s(blocks)``).
- ``scheduler.invariants``: ``check_kv_budget``, ``check_transitions``,
  ``check_shares``, ``check_anti_thrash``, ``check_starvation`` -> lists of
  ``Violation(invariant, detail)``; ``count_by_invariant``.
- ``scheduler.policy`` / ``scheduler.policies``: ``make_policy(spec,
  PolicyContext(tiers, est, costs, block_size))`` builds a ``SchedulingPolicy``
  from a spec ``NAME[:key=value,...]`` (``scheduler.policy_spec``): ``tierserve``
  (settings: its ordering and one switch per mechanism, ``TierserveSettings``),
  and the peers of ``scheduler.peers`` with their engines' flags: ``vllm-fcfs``,
  ``vllm-priority``, ``sglang-lpm``, ``sglang-fcfs``, ``dynamo-priority``. Its methods are the
  decisions a cluster asks for: ``admit``, ``place_prefill``, ``order`` /
  ``make_queue``, ``prefill_step_tokens``/``prefill_step_seconds`` (step
  budget), ``place_decode``, ``preempt_for``, ``on_kv_pressure``, ``tick``
  (every ``control_interval_s``), and the feedback calls ``record_demand``/
  ``record_served``/``observe_latency``; ``protected_hashes`` for reuse-aware
  prefix eviction. ``scheduler.testing`` has small factories for tests.
- ``scheduler.sim``: the discrete-event simulator, which drives the serving path's own
  ``ClusterScheduler`` and one ``WorkerScheduler`` per simulated worker against a cost
  model: ``Simulator(trace, policy_name, cluster, CostModel(profile), tiers,
  mode=PoolMode..., max_tokens=...).run()``,
  ``metrics.summarize(sim, load)``, trace readers in ``sim.traces``, cluster
  specs in ``sim.cluster``, profiles in ``sim.costmodel``, SLO capacity in
  ``sim.capacity`` and ``sim.slo``, the peers' tuning grids in ``sim.tuning``; the CLI
  is ``tierserve simulate`` (module ``scheduler.sim.cli``). Results:
  docs/scheduler-results.md.
"""
