"""The decode worker pool (lifecycle in decode_pool/worker.py).

    from decode_pool.worker import DecodeWorker, decode_worker_actor
    DecodeWorker(worker_id, cfg, engine, consumer, location, report, policy)
        .start(); await .reserve(msg) -> {"ok", "ticket", "num_cached_blocks", ...}
        await .prefilled({"req_id", "first_token", "finish"}); .stream(req_id) -> deltas
        await .preempt(req_id, "swap" | "recompute", for_req_id); await .abort(req_id)
    decode_worker_actor()    # the Ray actor class; stream() is a Ray streaming generator
"""
