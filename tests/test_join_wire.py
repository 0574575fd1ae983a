"""The join port of a served job across machines (runtime/wire.py, remote.py, host.py), on 127.0.0.1: every
message kind survives the wire as its declared type; a front admits only hosts that prove the job's secret, drops
a pickle, forged frames and a wrong proof with one log line each (nothing unpickled, nothing run), and keeps
serving a good host after; a secret is required off loopback, never defaulted, and `streamfusion launch` on one
machine makes one for its job."""
from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from streamfusion_diffusers.cli import main as cli_main
from streamfusion_diffusers.core.config import ParallelConfig
from streamfusion_diffusers.diffusers.stack.spec import Cache, Lora, Stack
from streamfusion_diffusers.runtime import wire
from streamfusion_diffusers.runtime.host import connect, run_host
from streamfusion_diffusers.runtime.job import Job
from streamfusion_diffusers.runtime.pool import free_port
from streamfusion_diffusers.runtime.progress import StepNote
from streamfusion_diffusers.runtime.remote import Front, Hosts
from streamfusion_diffusers.runtime.request import Request

SECRET = b"a-test-secret-of-enough-characters"
WAIT_S = 10.0  # a front answers (admits, drops) within this

JOB = Job(model="tiny-flux", weights=None, prompt="a red cat", height=64, width=64, frames=1, steps=2,
          guidance_scale=3.5, true_cfg_scale=None, max_sequence_length=16, seed=0, dtype="float32",
          parallel=ParallelConfig(machines=2, gpus_per_machine=2, method="auto", cfg="auto"), world_size=4,
          gpu=False, output="out", stack=Stack(cache=Cache("taylorseer", 5, 2), loras=(Lora("a.safetensors", 0.8),),
                                               adapters=(Lora("b", 1.0, "style"),)), images=(b"\x89PNG..",))
REQUEST = Request(prompt="a blue dog", negative_prompt=None, height=64, width=64, frames=1, steps=2, seed=7,
                  guidance_scale=None, n=2, lora=(("style", 0.6),), partial_images=1, images=(b"", b"\x00\xff"))
PREVIEW = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
EXAMPLES = [
    wire.Challenge("ab" * 32), wire.Response("cd" * 32, "ef" * 32), wire.Proof("01" * 32),
    wire.Hello(3, 1, 4242), wire.Beat(), wire.Bye(),
    wire.Start(1, 2, 4, 29501, "streamfusion/pool1/", False, 300.0),
    wire.Build(1, 1, JOB), wire.WarmUp(1, 2, ((64, 64, 1), (48, 64, 4))), wire.Run(1, 3, [REQUEST, REQUEST], 12.5),
    wire.Cancel(1, 3), wire.Stop(1, True), wire.Spawned(1, 999), wire.Exited(1, -9),
    wire.Result(1, {"build_s": 1.5, "startup_s": {"join": 0.2}, "pid": 7, "record": None}),
    wire.Images(1, [PREVIEW, PREVIEW[..., 0]], False, [{"request_id": "req-1", "steps": [0.1, 0.2]}],
                [b"RIFF....WAVE", None]),
    wire.Failed(1, "Traceback (most recent call last):\nValueError: boom"),
    wire.Note(1, StepNote(["req-1", "req-2"], 1, 2, 0.25, {"req-1": PREVIEW})),
]


def same(a: object, b: object) -> bool:
    """Equal values of equal types, arrays by dtype, shape and content."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def pair() -> tuple[wire.Channel, wire.Channel]:
    left, right = socket.socketpair()
    for end in (left, right):
        end.settimeout(WAIT_S)
    return wire.Channel(left), wire.Channel(right)


def test_every_message_kind_round_trips_as_its_declared_types():
    assert {type(m) for m in EXAMPLES} == set(wire.MESSAGES.values())
    sender, receiver = pair()
    for message in EXAMPLES:
        sender.send(message)
        got = receiver.receive()
        assert same(got, message), (got, message)
    assert type(got.note.previews["req-1"]) is np.ndarray
    build = next(m for m in EXAMPLES if isinstance(m, wire.Build))
    sender.send(build)
    assert receiver.receive().job.stack.cache.value == 5  # an int where a float is declared stays an int


def test_a_run_answer_carries_its_pixels_as_arrays_and_comes_back_as_pil_images():
    image = Image.fromarray(np.full((8, 6, 3), 200, np.uint8))
    frames = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (1, 2, 3)]
    sender, receiver = pair()
    for pixels, video, audio in (([image, image], False, [None, None]), ([frames], True, [b"RIFF....WAVE"])):
        message = wire.answer(5, True, {"pixels": pixels, "audio": audio, "records": [{"seconds": 1.0}]})
        assert isinstance(message, wire.Images) and message.video is video
        sender.send(message)
        ok, value = wire.received(receiver.receive())
        back = value["pixels"]
        assert ok and value["records"] == [{"seconds": 1.0}] and value["audio"] == audio
        flat = [f for p in back for f in p] if video else back
        want = [f for p in pixels for f in p] if video else pixels
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(flat, want))
    assert wire.received(wire.answer(5, False, "Traceback ...\nKeyError: 'x'")) == (False, "Traceback ...\nKeyError: 'x'")
    with pytest.raises(wire.WireError, match="0 sounds for 1 generations"):  # one sound (or None) per generation
        wire.Images(5, [PREVIEW], False, [{}], [])
    with pytest.raises(wire.WireError, match="JSON"):  # a value the wire does not declare is refused at the sender
        wire.frame(wire.answer(5, True, {"thing": object()}))


def raw(kind: object, fields: object = None, arrays: list | None = None, payload: bytes = b"",
        header_bytes: int | None = None, payload_bytes: int | None = None, magic: bytes = wire.MAGIC) -> bytes:
    """A hand-made frame, its lengths as given (default: true)."""
    header = json.dumps({"kind": kind, "fields": fields or {}, "arrays": arrays or []}).encode()
    size = len(header) if header_bytes is None else header_bytes
    return wire.PREFIX.pack(magic, size, len(payload) if payload_bytes is None else payload_bytes) + header + payload


class Marker:
    """A pickle whose load creates a file: what a front that unpickled it would leave behind."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple:
        return Path.touch, (self.path,)


def start_front(secret: bytes | None) -> Front:
    """A front of 2 slots on 127.0.0.1 (its store on the next port)."""
    for _ in range(20):
        port = free_port()
        try:
            return Front("127.0.0.1", port, 2, 2, 30.0, secret)
        except (OSError, RuntimeError):  # the next port was taken: another pair
            continue
    raise RuntimeError("no two free ports in a row")


def dropped(sock: socket.socket) -> bool:
    """Whether the front closed this connection (what it sent before, the challenge, read and skipped)."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def challenged(port: int) -> tuple[socket.socket, wire.Channel]:
    """A connection that has read the front's challenge."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    channel = wire.Channel(sock)
    assert isinstance(channel.expect(wire.Challenge), wire.Challenge)
    return sock, channel


def joined(front: Front, slot: int) -> wire.Channel:
    """A good host of `slot`: proved, said hello, and admitted."""
    channel = connect("127.0.0.1", front.port, SECRET, wait_s=WAIT_S)
    channel.sock.settimeout(WAIT_S)
    channel.send(wire.Hello(slot, slot // 2, os.getpid()))
    ends = time.monotonic() + WAIT_S
    while front.missing([slot]) and time.monotonic() < ends:
        time.sleep(0.02)
    assert not front.missing([slot])
    return channel


def test_the_front_drops_pickles_forged_frames_and_wrong_proofs_and_serves_a_good_host_after(tmp_path, caplog):
    marker = tmp_path / "unpickled"
    front = start_front(SECRET)
    caplog.set_level(logging.WARNING, logger="streamfusion_diffusers.runtime.remote")
    try:
        good = joined(front, 0)
        sock = socket.create_connection(("127.0.0.1", front.port), timeout=WAIT_S)  # multiprocessing's way in
        sock.sendall(struct.pack("!i", -1) + pickle.dumps(Marker(marker)))
        assert dropped(sock)
        forged = [
            pickle.dumps(Marker(marker)),  # a bare pickle
            wire.PREFIX.pack(wire.MAGIC, 40, 0) + pickle.dumps(Marker(marker))[:40],  # a pickle as the header
            raw("Exec", {"code": "import os"}),  # an unknown kind
            raw("Response", {"nonce": "ab" * 32}),  # a field missing
            raw("Response", {"nonce": "ab" * 32, "proof": 5}),  # a field of the wrong type
            raw("Response", {"nonce": "ab" * 32, "proof": "cd" * 32}),  # a wrong proof
            raw("Response", {"nonce": "ab" * 32, "proof": "cd" * 32}, header_bytes=30),  # the header cut short
            raw("Response", header_bytes=wire.HANDSHAKE_HEADER + 1),  # a header too large before the proof
            raw("Response", arrays=[["uint8", [4]]], payload=b"1234"),  # a payload before the proof
            raw("Response", magic=b"XXXX"),  # not a frame
        ]
        for frame in forged:
            sock, _ = challenged(front.port)
            sock.sendall(frame)
            assert dropped(sock), frame
        with pytest.raises(ConnectionError, match="join secret"):  # the wrong secret: the host is told, not admitted
            connect("127.0.0.1", front.port, b"another-secret-of-enough-chars", wait_s=WAIT_S)
        refused = [r for r in caplog.records if "was refused" in r.getMessage()]
        assert len(refused) == len(forged) + 2  # one line each (the multiprocessing client, the wrong secret)
        assert all("\n" not in r.getMessage() for r in refused)

        # a host that proved the secret and then breaks the protocol is dropped too, its slot free again
        for frame in (raw("Spawned", {"pool": 1, "pid": 5}, arrays=[["uint8", [3, 4]]], payload=b"x" * 10),
                      raw("Spawned", {"pool": 1, "pid": 5}, arrays=[["uint8", [3, 4]]], payload=b"x" * 12,
                          payload_bytes=10),
                      wire.PREFIX.pack(wire.MAGIC, 60, 0) + pickle.dumps(Marker(marker)).ljust(60, b" "),
                      raw("Hello", header_bytes=wire.MAX_HEADER + 1),
                      raw("Images", {"pool": 1, "pixels": [0], "video": False, "records": []},
                          arrays=[["float32", [2, 2]]], payload=bytes(16)),  # pixels not an image's
                      raw("Spawned", {"pool": 0, "pid": 5})):  # a number out of its range
            host = joined(front, 1)
            host.sock.sendall(frame)
            assert dropped(host.sock)
            assert front.missing([1])
        assert not marker.exists()

        # the good host was served all along: it gets its pool's start, and the front's goodbye
        pool = Hosts(front, (0,)).pool(False, 30.0, lambda: False)
        start = good.receive()
        assert isinstance(start, wire.Start) and (start.pool, start.rank, start.world) == (pool.id, 0, 1)
        with pytest.raises(ValueError, match="cannot run on ranks across machines"):
            pool.run(print, "hi")
        pool.close(stop=True)
        assert same(good.receive(), wire.Stop(pool.id, True))
        front.close()
        assert isinstance(good.receive(), wire.Bye)
    finally:
        front.close()


def test_a_secret_is_required_off_loopback_and_never_defaulted(monkeypatch):
    monkeypatch.delenv(wire.JOIN_KEY_ENV, raising=False)
    assert wire.join_secret() is None
    for start in (lambda: Front("192.0.2.1", free_port(), 2, 2, 30.0, None),
                  lambda: run_host("192.0.2.1", free_port(), 1, 0, None, watch_parent=False)):
        with pytest.raises(ValueError, match=f"--join-secret or set the same \\${wire.JOIN_KEY_ENV}") as err:
            start()
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="fewer than 16"):
        wire.join_secret("short")
    monkeypatch.setenv(wire.JOIN_KEY_ENV, SECRET.decode())
    assert wire.join_secret() == SECRET and wire.join_secret("given-on-the-command-line") == b"given-on-the-command-line"


@pytest.mark.parametrize("nnodes, preset, made", [(1, None, True), (1, SECRET.decode(), False), (2, None, False)])
def test_launch_on_one_machine_makes_the_jobs_secret(monkeypatch, nnodes, preset, made):
    if preset is None:
        monkeypatch.delenv(wire.JOIN_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(wire.JOIN_KEY_ENV, preset)
    seen: dict[str, str] = {}
    monkeypatch.setattr(os, "execve", lambda path, argv, env: seen.update(env))
    cli_main(["launch", "--nnodes", str(nnodes), "--nproc-per-node", "2", "-m", "streamfusion_diffusers", "serve"])
    secret = seen.get(wire.JOIN_KEY_ENV)
    if made:
        assert secret is not None and len(secret) >= 32 and secret != os.environ.get(wire.JOIN_KEY_ENV)
    else:
        assert secret == preset
