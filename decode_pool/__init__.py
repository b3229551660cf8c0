"""The decode worker pool: a thin applier of :class:`scheduler.worker_core.DecodeCore`.

    from decode_pool.worker import DecodeWorker
    DecodeWorker(info, engine, consumer, policy, costs, limits, report, start_prefill)
        .start(); await .dispatch(Dispatch) -> DispatchAnswer
        await .prefilled(PrefilledBatch); .subscribe(router_id) -> TokenBatch bytes per step
        await .preempt(req_id, PreemptMode.SWAP | RECOMPUTE | MIGRATE, for_req_id, target)
        await .migrate_in(MigrateIn) -> MigrateAnswer; await .abort(req_id)
    cluster.worker_actors.decode_worker_actor()    # the Ray actor class (msgpack bytes in
                                                   # and out); subscribe is a Ray streaming
                                                   # generator
"""
