"""`streamfusion serve`: the pipeline behind an OpenAI-compatible HTTP API, built once and kept warm.

One job per module: command (the CLI entry and its options), app (the HTTP routes and the layers in front of
them), protocol (OpenAI's request and response shapes, pydantic), validation (every request checked against the
served job and its limits), errors (OpenAI's error shape), work (the bounded queue), service (the front's
supervisor: the queue, the groups, restarts and drain), groups (one parallel group of rank processes), ranks
(what runs in each rank process), videos (video jobs), metrics (prometheus_client), page.html (the page at `/`). The shape is in docs/ARCHITECTURE.md, "Serving".
"""
