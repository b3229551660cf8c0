"""The prefill worker pool (lifecycle in prefill_pool/worker.py).

    from prefill_pool.worker import PrefillWorker, prefill_worker_actor
    PrefillWorker(worker_id, cfg, engine, producer, location, report, notify_decode, policy)
        .start(); await .start_request({"spec", "ticket", "decode_worker_id"}); await .abort(id)
    prefill_worker_actor()   # the Ray actor class: setup(), start_request(bytes), abort, ping
"""
