"""The decode worker pool: :class:`decode_pool.worker.DecodeWorker`, a thin applier of
:class:`scheduler.worker_core.DecodeCore`; its Ray actor is ``cluster.worker_actors``."""
