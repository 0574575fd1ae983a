"""The serve front's outer layer on its own (no server, no ranks): an unexpected error inside a route is answered
500 in OpenAI's shape with the request id and nothing of the error, and the traceback goes to the log under that
id; the Host check of a loopback server; the request checks that need no ranks (magcache's steps, an edit model
on /v1/images/generations, Flux.2's smallest references, MiniMax-H3's clip lengths)."""
from __future__ import annotations

import asyncio
import logging
import threading

import httpx

import io

import pytest
from PIL import Image

from streamfusion_diffusers.serve.edge import Edge
from streamfusion_diffusers.serve.metrics import Metrics

SECRET = "/srv/internal/path.py: token=abc123"


async def _failing_route(scope: dict, receive, send) -> None:
    raise RuntimeError(SECRET)


def _get(app, **headers: str) -> httpx.Response:
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            return await c.get("/v1/models", headers=headers)

    return asyncio.run(one())


def test_an_unexpected_error_is_500_with_the_request_id_and_no_traceback(caplog):
    metrics = Metrics()
    with caplog.at_level(logging.ERROR, logger="streamfusion_diffusers.serve.edge"):
        answer = _get(Edge(_failing_route, metrics, loopback=True, allow_origins=()))
    request_id = answer.headers["x-request-id"]
    error = answer.json()["error"]
    assert answer.status_code == 500 and error["type"] == "server_error" and error["code"] == "internal_error"
    assert request_id in error["message"] and "log" in error["message"]
    assert SECRET not in answer.text and "Traceback" not in answer.text and "RuntimeError" not in answer.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])
    assert b'status="500"' in metrics.render(0, 0, {})


def test_a_loopback_server_answers_only_loopback_names():
    async def fine(scope: dict, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    edge = Edge(fine, Metrics(), loopback=True, allow_origins=())
    assert _get(edge, Host="attacker.example:8000").status_code == 421
    assert _get(edge, Host="127.0.0.1.attacker.example").status_code == 421
    assert _get(edge, Host="[::1]:8000").status_code == 200
    public = Edge(fine, Metrics(), loopback=False, allow_origins=())  # --host 0.0.0.0: any name
    assert _get(public, Host="gpu-box.example:8000").status_code == 200


def test_magcache_refuses_a_step_count_other_than_the_servers_saying_why():
    import argparse

    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.limits import limits
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.protocol import ImageRequest
    from streamfusion_diffusers.serve.validation import Checker

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-flux", "--cache", "magcache", "--steps", "4"])
    job, _ = serve_job(args)
    checker = Checker(job, limits(args, job))
    assert checker.image(ImageRequest(prompt="a", num_inference_steps=4)).steps == 4
    assert checker.image(ImageRequest(prompt="a")).steps == 4
    try:
        checker.image(ImageRequest(prompt="a", num_inference_steps=6))
    except ApiError as err:
        assert err.status == 400 and err.param == "num_inference_steps" and "--cache magcache" in err.message
        assert "ask for 4" in err.message
    else:
        raise AssertionError("a magcache server took another step count")


def _checker(*argv: str):
    import argparse

    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.limits import limits
    from streamfusion_diffusers.serve.validation import Checker

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(argv))
    job, _ = serve_job(args)
    return Checker(job, limits(args, job))


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def test_an_edit_model_refuses_generations_pointing_to_edits():
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.protocol import ImageRequest

    with pytest.raises(ApiError) as refused:
        _checker("--model", "tiny-qwen-image-edit").image(ImageRequest(prompt="a red cat"))
    assert refused.value.status == 400 and refused.value.code == "wrong_endpoint"
    assert "POST /v1/images/edits" in refused.value.message


@pytest.mark.parametrize(("sizes", "words"), [
    (((63, 128),), "image: 63x128 pixels: Flux.2 takes input images of at least 64 pixels a side"),
    (((64, 64), (40, 40)), "image[1]: 40x40 pixels: Flux.2 takes input images of at least 64 pixels a side"),
    (((64, 520),), "image: 64x520 pixels: Flux.2 takes input images of at most 8:1"),
])
def test_flux2_refuses_references_its_pipeline_cannot_take_before_any_rank(sizes, words):
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.protocol import EditRequest

    checker = _checker("--model", "tiny-flux2")
    taken = checker.edit(EditRequest(prompt="a red cat"), {"image": [_png(64, 64), _png(64, 512)]})
    assert len(taken.images) == 2
    with pytest.raises(ApiError) as refused:
        checker.edit(EditRequest(prompt="a red cat"), {"image": [_png(*size) for size in sizes]})
    assert refused.value.status == 400 and refused.value.param == "image"
    assert refused.value.message.startswith(words), refused.value.message


def test_minimax_h3_takes_the_seconds_its_pipeline_makes_and_no_guidance_before_any_rank():
    """MiniMax-H3 makes 5 to 15 s clips of 17k + 5 frames at 24 fps: `seconds` become the fewest such frames that
    last them, up to the server's 248 frames; a shorter or longer clip, or a guidance scale, is one line."""
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.protocol import VideoRequest

    checker = _checker("--model", "tiny-minimax-h3")
    assert [checker.video(VideoRequest(prompt="a", seconds=s)).frames for s in (5, 10)] == [124, 243]
    for fields, param, words in [
        ({"seconds": 4}, "seconds", "seconds 4: must be from 5 to 10"),
        ({"seconds": 11}, "seconds", "seconds 11: must be from 5 to 10"),
        ({"num_frames": 107}, "num_frames", "num_frames 107: must be from 124 to 345 (5 to 15 s at 24 fps)"),
        ({"guidance_scale": 4}, "guidance_scale",
         "guidance_scale: tiny-minimax-h3 has none (guidance-distilled); drop the field")]:
        with pytest.raises(ApiError) as refused:
            checker.video(VideoRequest(prompt="a", **fields))
        assert (refused.value.status, refused.value.param, refused.value.message) == (400, param, words)


def test_requests_wait_for_the_limits_found_beside_the_start():
    """On GPUs the memory planner finds the request limits while the ranks start (serve/command.py): a request
    that comes before waits for them (the loop stays free: /health answers meanwhile), then is checked against
    them; a planner that failed answers 503."""
    import argparse
    from concurrent.futures import Future

    from streamfusion_diffusers.serve.app import make_app
    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.limits import limits
    from streamfusion_diffusers.serve.service import Service

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-flux", "--cpu"])
    job, devices = serve_job(args)

    async def run(found: Future, answer_with) -> tuple[int, int, dict]:
        service = Service(job, found, devices, 4, 60.0, lambda _: None, lambda _: None)  # never started: no ranks
        app = make_app(service, None, 1 << 20)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            asking = asyncio.create_task(c.post("/v1/images/generations",
                                                json={"prompt": "a", "size": "256x256"}))
            await asyncio.sleep(0.3)
            health = await c.get("/health")  # answered while the request waits
            assert not asking.done()
            answer_with(found)
            answer = await asyncio.wait_for(asking, 10)
        return health.status_code, answer.status_code, answer.json()

    def bounded(answer_with) -> tuple[int, int, dict]:  # a loop held by a blocking wait fails, not hangs, the test
        got: list = []
        thread = threading.Thread(target=lambda: got.append(asyncio.run(run(Future(), answer_with))), daemon=True)
        thread.start()
        thread.join(30)
        assert got, "the request's wait for the limits held the server's loop"
        return got[0]

    small = limits(parser.parse_args(["--model", "tiny-flux", "--cpu", "--max-pixels", "4096"]), job)
    health, status, body = bounded(lambda f: f.set_result(small))
    assert health == 503 and status == 400, body  # starting; then refused by the limits that came late
    assert body["error"]["param"] == "size" and "at most 4096" in body["error"]["message"], body
    health, status, body = bounded(lambda f: f.set_exception(ValueError("does not fit")))
    assert status == 503 and "could not start" in body["error"]["message"], body


def test_a_planner_that_refuses_the_job_ends_the_start_at_once():
    """The limits' planner runs beside the ranks' start: its refusal (the model fits no size) stops the server at
    once, with the planner's error for the command to say, not after the ranks have built."""
    import argparse
    from concurrent.futures import Future

    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.service import Service

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job, _ = serve_job(parser.parse_args(["--model", "tiny-flux", "--cpu"]))
    exits: list[int] = []

    async def run() -> Service:
        found: Future = Future()
        service = Service(job, found, [], 4, 60.0, lambda _: None, exits.append)  # no group: no ranks to start
        await service.start()
        threading.Thread(target=found.set_exception, args=(ValueError("fits no size"),)).start()
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.02)
        return service

    service = asyncio.run(run())
    assert exits == [1] and str(service.failure) == "fits no size"


def test_a_planner_error_read_by_a_request_is_not_logged_as_never_retrieved(caplog):
    """A request that waits for the limits reads the planner's error; asyncio's copy of the planner's future holds
    it too, and must not be collected unread (asyncio's "Future exception was never retrieved")."""
    import argparse
    import gc
    from concurrent.futures import Future

    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.service import Service

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job, _ = serve_job(parser.parse_args(["--model", "tiny-flux", "--cpu"]))

    async def run() -> None:
        found: Future = Future()
        service = Service(job, found, [], 4, 60.0, lambda _: None, lambda _: None)  # never started: no ranks
        found.set_exception(ValueError("fits no size"))
        try:
            await service.limits_known()
        except ValueError as err:
            said.append(str(err))  # (the traceback, and the frames holding the copy, go with the except block)
        del service, found  # the planner's future, whose callback holds the copy: as when a server stops
        gc.collect()  # the copy is collected here, on the running loop

    said: list[str] = []

    asyncio.run(run())
    assert said == ["fits no size"] and "never retrieved" not in caplog.text, caplog.text
