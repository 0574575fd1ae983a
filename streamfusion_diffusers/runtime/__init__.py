"""The runtime under `generate` and `serve`: a job (job.py), the pipeline's build and what one call of it says
(build.py), one request and which requests share a pipeline call (request.py, batch.py, invariant.py), the rank
processes and the protocol they speak (pool.py, rank.py, worker.py, group.py; across machines remote.py and
host.py, over wire.py's typed frames), where the time goes (phases.py), and what the pixels become (output.py). Nothing here knows HTTP."""
