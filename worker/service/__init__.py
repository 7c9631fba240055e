"""Everything that runs inside a worker process; `worker.py` is the composition root."""
