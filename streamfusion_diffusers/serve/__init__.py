"""`streamfusion serve`: the pipeline behind an OpenAI-compatible HTTP API, built once and kept warm.

One job per module: command (the CLI entry and its options), app (the HTTP app: its own routes, errors, the
draining server), edge (the layers in front of the routes: request id, Host/Origin, API key, body checks),
image_routes and video_routes (OpenAI's images and videos routes), protocol (OpenAI's request and response shapes,
pydantic), validation (every request checked against the served job and its limits), errors (OpenAI's error shape),
events (a streamed request's server-sent events), work (the bounded queue), service (the front's state, videos,
health and drain) made of supervision (the groups started and restarted), running (a batch run, its answers
encoded) and following (a request from its client's side: followed, dropped, cancelled), videos (video jobs),
metrics (prometheus_client), page.html (the page at `/`). The shape is in docs/ARCHITECTURE.md, "Serving".
"""
