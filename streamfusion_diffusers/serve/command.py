"""`streamfusion serve`: build and parallelize a pipeline once, keep it warm, and serve it over HTTP with an
OpenAI-compatible API (POST /v1/images/generations; /v1/videos for video models; /v1/models, /health, /metrics,
and a page to try it at /).

It takes the model and every parallel option of `generate` (the same job options) and starts the ranks as
`generate` does: one process per visible GPU, else 4 gloo processes on the CPU. `--replicas R` splits them into
R parallel groups of P / R ranks that each serve a request at once, behind one queue. The HTTP front and the
supervisor are this process; the ranks are its children. Binds 127.0.0.1 unless --host says otherwise.

Across machines, the same command runs under `streamfusion launch` (or torchrun) on every machine: the process of
global rank 0 is the front, every launched process a host of its rank (runtime/remote.py, runtime/host.py), and a
group lies inside a machine or spans machines as `--replicas` splits them (`replica_shape`, `group_slots`).
"""
from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import logging
import math
import os
import socket
import sys
import threading

import torch

from ..choice.replicas import replica_shape
from ..runtime.batch import max_batch
from ..runtime.arguments import add_arguments as add_job_arguments
from ..runtime.job import Job, cluster, make_job, real_size
from ..core.extras import install_hint
from ..core.join import launched
from ..runtime.wire import JOIN_KEY_ENV, join_secret
from ..models.pipelines import family_of
from .limits import planned_limits
from .videos import Keep
from .warm import check_sizes, parse_sizes

API_KEY_ENV = "STREAMFUSION_API_KEY"
# generate's options that mean something else here (what a request does not give, and the warm-up)
RETITLED = {"prompt": "the warm-up generation's prompt", "seed": "the warm-up generation's seed (a request gives its own)",
            "height": "default height of a request (default: the model's)",
            "width": "default width of a request (default: the model's)",
            "frames": "default frames of a video request (default: the model's)",
            "steps": "default num_inference_steps of a request (default: the model's)",
            "output": argparse.SUPPRESS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    for action in parser._actions:
        if action.dest in RETITLED:
            action.help = RETITLED[action.dest]
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every one)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one, printed)")
    parser.add_argument("--api-key", default=None,
                        help=f"every /v1 route needs 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="parallel groups that each serve a request at once, P / R ranks each (default 1: "
                             "all ranks on every request, the lowest latency)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests that may wait for a group; beyond it 429 with Retry-After (default 16)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds from arrival to answer; past it 504, the ranks stopping together at a step "
                             "(default 600)")
    parser.add_argument("--build-timeout", type=float, default=None, metavar="SECONDS",
                        help="most seconds a group may take to start (ranks, build, warm-up); past it the start "
                             "fails (default: no bound)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="after SIGTERM, most seconds the accepted requests may still take; past it they are "
                             "answered 503 and the server exits (default 60)")
    parser.add_argument("--max-n", type=int, default=4, help="most images per request (default 4)")
    parser.add_argument("--max-steps", type=int, default=100, help="most num_inference_steps (default 100)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="most width x height of a request (default on GPUs: the largest the memory planner "
                             "fits on one GPU of a group; on the CPU 16 x the model's default size, 4 x each side)")
    parser.add_argument("--max-frames", type=int, default=None,
                        help="most frames of a video request (default on GPUs: the most the memory planner fits at "
                             "the model's default size; on the CPU 2 x the model's default frames)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="most images one pipeline call takes, from requests of one size, steps and guidance "
                             "(default: the job's; 1: every request alone)")
    parser.add_argument("--batch-wait-ms", type=float, default=15.0,
                        help="how long a free group waits for more requests of a shape after the last that came "
                             "(default 15; at most 4 x that after the first, or a twentieth of the group's last "
                             "call while fewer than its last batch have come)")
    parser.add_argument("--warm-sizes", type=parse_sizes, default=None, metavar="WxH[,WxH...]",
                        help="sizes made before the server says ready, each at one image and, with --compile, at "
                             "--max-batch images, so that no request of them waits for a compile; with two or more "
                             "sizes the blocks compile with the token count symbolic and no size compiles after "
                             "ready (default: the model's own size)")
    parser.add_argument("--max-prompt-chars", type=int, default=4000, help="longest prompt (default 4000)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--keep-videos", type=int, default=Keep.count,
                        help=f"finished video jobs kept (their mp4 files too), the oldest forgotten first (default "
                             f"{Keep.count})")
    parser.add_argument("--keep-video-bytes", type=int, default=Keep.bytes,
                        help=f"most bytes of finished mp4 files kept, the oldest removed first (default {Keep.bytes}, "
                             f"4 GiB; the newest stays however large)")
    parser.add_argument("--video-ttl", type=float, default=Keep.ttl_s,
                        help=f"seconds a finished video is kept (default {Keep.ttl_s:g}); its expires_at says when")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a site whose pages may call the API from a browser (CORS), as scheme://host[:port]; "
                             "repeatable (default: none, only the page at / of this server)")
    parser.add_argument("--join-port", type=int, default=None,
                        help="across machines (under streamfusion launch / torchrun): the port of node 0 the launched "
                             "processes of every node join the front at; the next port is their groups' store "
                             "(default: --master-port + 1)")
    parser.add_argument("--join-secret", default=None, metavar="SECRET",
                        help=f"across machines: the job's secret, the same on every node, that the launched processes "
                             f"and the front prove to each other at the join port (default: ${JOIN_KEY_ENV}, which "
                             f"other users cannot read from the process list; streamfusion launch on one machine "
                             f"makes one); required unless node 0's address is loopback")
    parser.add_argument("--log-requests", action=argparse.BooleanOptionalAction, default=True,
                        help="one line per request on stderr: id, method, path, status, seconds, bytes, size and "
                             "steps (default on)")


def group_slots(machines: int, per_machine: int, replicas: int) -> list[list[int]]:
    """Each group's global ranks (rank = node x per_machine + local rank), in the group's rank order: groups of
    whole machines, or an equal share of every machine (`replica_shape`)."""
    group_machines, group_per_machine = replica_shape(machines, per_machine, replicas)
    per_node = per_machine // group_per_machine
    return [[(g // per_node * group_machines + i) * per_machine + g % per_node * group_per_machine + j
             for i in range(group_machines) for j in range(group_per_machine)] for g in range(replicas)]


def group_devices(replicas: int, size: int, gpu: bool) -> list[list[str] | None]:
    """Each group's GPUs (as CUDA_VISIBLE_DEVICES entries, within what this process sees); None on the CPU."""
    if not gpu:
        return [None] * replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return [ids[g * size:(g + 1) * size] for g in range(replicas)]


def serve_job(args: argparse.Namespace) -> tuple[Job, list[list[str] | None]]:
    """The job one group runs, and each group's devices; everything checked before any process starts."""
    needs = ("fastapi", "uvicorn", "python_multipart", "prometheus_client")
    if any(importlib.util.find_spec(name) is None for name in needs):
        raise ValueError(f"streamfusion serve needs fastapi, uvicorn, python-multipart and prometheus_client: "
                         f"{install_hint('serve')}")
    machines, per_machine, gpu = cluster(args)
    args.machines, args.gpus_per_machine = replica_shape(machines, per_machine, args.replicas)
    job = make_job(args, (args.machines, args.gpus_per_machine, gpu), serving=True)
    if real_size(job.model) and family_of(job.model).encode_first and not job.weights:
        raise ValueError(f"{job.model} with random weights encodes its one prompt before the transformer is built "
                         f"(the two do not fit one GPU together), so it cannot take a prompt per request: serve it "
                         f"with --weights, or serve another model")
    args.warm_sizes = check_sizes(job, args.warm_sizes)
    if job.spec.video and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ValueError(f"serving video needs an mp4 encoder: {install_hint('diffusers')}")
    if launched():  # each launched process's GPU is its LOCAL_RANK's
        return job, [None] * args.replicas
    return job, group_devices(args.replicas, job.world_size, gpu)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any rank starts (a busy port is one line, not a failed job)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = "choose another --port (0: any free one)" if err.errno == errno.EADDRINUSE else "check --host"
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}; {hint}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def loopback(host: str) -> bool:
    """Whether `host` is this machine only (then a request naming another Host is refused: DNS rebinding)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def log_to_stderr(requests: bool) -> None:
    """The server's own lines (a group failing, an unexpected error with its request id) on stderr, and the
    access log's too unless --no-log-requests."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("streamfusion serve: %(message)s"))
    serve = logging.getLogger(__package__)
    serve.addHandler(handler)
    serve.setLevel(logging.INFO)
    serve.propagate = False
    logging.getLogger(f"{__package__}.access").setLevel(logging.INFO if requests else logging.WARNING)


def launched_shape() -> tuple[int, int]:
    """(machines, processes per machine) of the launcher's job."""
    world = int(os.environ["WORLD_SIZE"])
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world // per_machine, per_machine


def join_address(args: argparse.Namespace) -> tuple[str, int]:
    """Node 0's address and join port, under a launcher."""
    port = args.join_port or int(os.environ.get("MASTER_PORT", 29500)) + 1
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), port


def main(args: argparse.Namespace) -> int:
    job, devices = serve_job(args)
    if launched() and int(os.environ["RANK"]) != 0:  # a host of its rank: the front runs on global rank 0
        from ..runtime.host import run_host

        world = int(os.environ["WORLD_SIZE"])
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return run_host(*join_address(args), int(os.environ["RANK"]), int(os.environ["RANK"]) // per_machine,
                        join_secret(args.join_secret))
    keep = Keep(args.keep_videos, args.keep_video_bytes, args.video_ttl)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"streamfusion serve: listening on {args.host} without --api-key: anyone who reaches this port can "
              f"run the GPUs", file=sys.stderr)
    for origin in args.allow_origin:
        parts = origin.split("://")
        if len(parts) != 2 or parts[0] not in ("http", "https") or not parts[1] or "/" in parts[1]:
            raise ValueError(f"--allow-origin {origin}: must be scheme://host[:port] (e.g. http://localhost:3000), "
                             f"as a browser sends it in Origin")
    sock = listen(args.host, args.port)
    log_to_stderr(args.log_requests)
    import uvicorn

    from .app import DrainingServer, make_app
    from .service import Service

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server: DrainingServer | None = None
    exit_code = 0

    def ready(service: Service) -> None:
        info = service.groups[0].info["record"]
        groups = f"{len(service.groups)} x " if len(service.groups) > 1 else ""
        cfg = f"cfg {info['cfg']} x " if info["cfg"] > 1 else ""
        print(f"serving {job.model} on http://{shown}:{port} ({groups}{cfg}{info['layout']}, {info['backend']})",
              flush=True)

    def stop(code: int) -> None:
        nonlocal exit_code
        exit_code = max(exit_code, code)
        if server is not None:
            server.should_exit = True

    if (args.max_batch is not None and args.max_batch < 1) or args.batch_wait_ms < 0:
        raise ValueError("--max-batch must be at least 1 and --batch-wait-ms at least 0")
    if (args.build_timeout is not None and args.build_timeout <= 0) or args.drain_timeout < 0:
        raise ValueError("--build-timeout must be more than 0 seconds and --drain-timeout at least 0")
    front, hosts = None, None
    if launched():  # this process is the front of a job across machines, and the host of its rank 0
        from ..runtime.host import run_host
        from ..runtime.remote import Front, Hosts

        machines, per_machine = launched_shape()
        secret = join_secret(args.join_secret)
        front = Front(join_address(args)[0], join_address(args)[1], machines * per_machine, per_machine,
                      job.parallel.timeout_s, secret)
        threading.Thread(target=run_host, args=(*join_address(args), 0, 0, secret, False), daemon=True).start()
        hosts = [Hosts(front, tuple(slots)) for slots in group_slots(machines, per_machine, args.replicas)]
    service = Service(job, planned_limits(args, job), devices, args.max_queue, args.request_timeout, ready, stop, keep,
                      max_batch=args.max_batch or max_batch(job), batch_wait_s=args.batch_wait_ms / 1000,
                      build_timeout_s=args.build_timeout or math.inf, drain_timeout_s=args.drain_timeout,
                      hosts=hosts, warm_sizes=args.warm_sizes)
    app = make_app(service, api_key, args.max_body_bytes, loopback(args.host), tuple(args.allow_origin))
    config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", timeout_graceful_shutdown=5,
                            access_log=False)
    server = DrainingServer(config, service)
    try:
        server.run(sockets=[sock])
    finally:
        if front is not None:
            front.close()
    if service.failure is not None:
        raise service.failure
    return exit_code


__all__ = ["add_arguments", "main"]
