"""The prefill worker pool (lifecycle in prefill_pool/worker.py).

    from prefill_pool.worker import PrefillWorker
    PrefillWorker(info, engine, producer, policy, costs, limits, report, notify_decode)
        .start(); await .start_request(StartPrefill) -> None | why not; await .abort(req_id)
    cluster.worker_actors.prefill_worker_actor()   # the Ray actor class (msgpack bytes in
                                                   # and out): setup, start_request, abort,
                                                   # ping, status
"""
