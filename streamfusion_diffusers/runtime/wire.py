"""The join port's wire: the typed messages between the front of a served job across machines and its hosts
(remote.py, host.py), as frames on a plain TCP socket, and the handshake that opens a connection.

Nothing from a socket is unpickled or looked up by name. A frame is a fixed prefix (a magic, the header's length,
the payload's length), a JSON header and a payload of raw bytes. The header names a message kind from a closed
set (MESSAGES) and gives its fields; each field is rebuilt as the type its message declares (numbers within their
ranges, strings, the job's and the requests' dataclasses through their own checks, JSON data for the records)
and anything else is refused. Arrays and byte strings travel in the payload, each declared in the header by dtype
and shape: the payload must be exactly as long as they say. Frames are bounded: before a peer has proved the
secret, a few hundred bytes and no payload.

The handshake is an HMAC challenge-response both ways over fresh nonces: the host proves it knows the job's
secret, then the front does, before either says anything else. Without a secret (loopback only: remote.py) the
key is empty, so the same handshake runs and proves nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import struct
import threading
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Literal, NewType

import numpy as np
from PIL import Image

from .job import Job
from .progress import StepNote
from .request import Request

JOIN_KEY_ENV = "STREAMFUSION_JOIN_KEY"  # the job's secret, the same on every node (or --join-secret)
MIN_SECRET_CHARS = 16  # a shorter secret falls to an offline guess from one recorded handshake
MAGIC = b"SFJ1"  # what every frame starts with: the protocol and its version
PREFIX = struct.Struct("!4sIQ")  # magic, header bytes, payload bytes
HANDSHAKE_HEADER = 1024  # the largest header before the peer has proved the secret (and no payload then)
MAX_HEADER = 16 << 20  # the largest header: a batch's records
MAX_PAYLOAD = 8 << 30  # the largest payload: a batch of long videos' frames
MAX_ARRAYS = 1 << 12  # arrays in one frame
NONCE_BYTES = 32  # a nonce's random bytes (and a secret's, where `streamfusion launch` makes one)
DTYPES = ("uint8",)  # what an array may hold: pixels, previews, files' bytes
MAX_WORLD = 1 << 16  # ranks of a job, at most
MAX_ID = 1 << 62  # pool and call numbers
Json = NewType("Json", object)  # JSON data (a run's records): what json.loads makes, nothing more


class WireError(ValueError):
    """A frame or a message that breaks the protocol, or a peer that failed the handshake."""


def join_secret(given: str | None = None) -> bytes | None:
    """The job's secret: `given` (--join-secret), else $STREAMFUSION_JOIN_KEY, else None (never a default)."""
    text = given or os.environ.get(JOIN_KEY_ENV) or None
    if text is not None and len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"the join secret (--join-secret or ${JOIN_KEY_ENV}) has {len(text)} characters, fewer than "
                         f"{MIN_SECRET_CHARS}: use a random one, e.g. `openssl rand -hex 16`")
    return None if text is None else text.encode()


def new_secret() -> str:
    """A fresh random secret for one job (what `streamfusion launch` makes where it starts every process)."""
    return secrets.token_hex(NONCE_BYTES)


def local_only(host: str) -> bool:
    """Whether `host` is a loopback address: a join port there is reachable from this machine only."""
    return host in ("127.0.0.1", "localhost", "::1")


def require_secret(secret: bytes | None, host: str) -> None:
    """Refuse a join port off loopback without the job's secret: anyone reaching it would join the job."""
    if secret is None and not local_only(host):
        raise ValueError(f"serving across machines at {host} needs the job's join secret: pass the same "
                         f"--join-secret or set the same ${JOIN_KEY_ENV} on every node (e.g. `openssl rand -hex 16`)")


@dataclass(frozen=True)
class Message:
    """One message of the join port. `limits`: each number field's inclusive range."""

    limits: ClassVar[dict[str, tuple[float, float]]] = {}

    def __post_init__(self) -> None:
        for name, (low, high) in self.limits.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise WireError(f"{type(self).__name__}.{name} = {value!r} is not within {low:g} .. {high:g}")


@dataclass(frozen=True)
class Handshake(Message):
    """A handshake step: every field a nonce or a proof, 64 hex digits."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if len(value) != 2 * NONCE_BYTES or value.strip("0123456789abcdef"):
                raise WireError(f"{type(self).__name__}.{f.name} must be {2 * NONCE_BYTES} hex digits")


POOL = {"pool": (1, MAX_ID)}
CALL = {**POOL, "call": (1, MAX_ID)}


@dataclass(frozen=True)
class Challenge(Handshake):
    """The front's first word: a fresh nonce the host's proof must cover."""

    nonce: str


@dataclass(frozen=True)
class Response(Handshake):
    """The host's proof of the secret over both nonces, and its own nonce for the front's proof."""

    nonce: str
    proof: str


@dataclass(frozen=True)
class Proof(Handshake):
    """The front's proof of the secret over both nonces."""

    proof: str


@dataclass(frozen=True)
class Hello(Message):
    """A host's slot (its global rank), node and process id, once both sides are proved."""

    slot: int
    node: int
    pid: int
    limits = {"slot": (0, MAX_WORLD - 1), "node": (0, MAX_WORLD - 1), "pid": (1, 2 ** 31 - 1)}


@dataclass(frozen=True)
class Beat(Message):
    """A host is alive."""


@dataclass(frozen=True)
class Bye(Message):
    """The front ends the job: the host exits 0."""


@dataclass(frozen=True)
class Start(Message):
    """Spawn this host's rank of a pool: it joins the pool's process group at the front's store."""

    pool: int
    rank: int
    world: int
    store_port: int
    prefix: str
    gpu: bool
    timeout_s: float
    limits = {**POOL, "rank": (0, MAX_WORLD - 1), "world": (1, MAX_WORLD), "store_port": (1, 65535),
              "timeout_s": (1e-3, math.inf)}


@dataclass(frozen=True)
class Build(Message):
    """Call worker.build(job) on the rank."""

    pool: int
    call: int
    job: Job
    limits = CALL


@dataclass(frozen=True)
class WarmUp(Message):
    """Call worker.warm_up(shapes) on the rank: each (width, height, images in the call)."""

    pool: int
    call: int
    shapes: tuple[tuple[int, int, int], ...]
    limits = CALL


@dataclass(frozen=True)
class Run(Message):
    """Call worker.run(batch, deadline_s) on the rank."""

    pool: int
    call: int
    batch: list[Request]
    deadline_s: float
    limits = {**CALL, "deadline_s": (0.0, math.inf)}


@dataclass(frozen=True)
class Cancel(Message):
    """Stop call `call` of the pool where its ranks next agree on it."""

    pool: int
    call: int
    limits = CALL


@dataclass(frozen=True)
class Stop(Message):
    """End the rank: after its collective shutdown, or with `now` at once."""

    pool: int
    now: bool
    limits = POOL


@dataclass(frozen=True)
class Spawned(Message):
    """The rank process's id."""

    pool: int
    pid: int
    limits = {**POOL, "pid": (1, 2 ** 31 - 1)}


@dataclass(frozen=True)
class Exited(Message):
    """The rank process ended by itself: its exit code (negative: the signal that killed it)."""

    pool: int
    code: int
    limits = {**POOL, "code": (-255, 255)}


@dataclass(frozen=True)
class Result(Message):
    """A call's answer that is JSON data: the start-up's and the other ranks' None, the build's and warm-up's
    timings and record, a run stopped together."""

    pool: int
    value: Json
    limits = POOL


@dataclass(frozen=True)
class Images(Message):
    """Rank 0's answer to a run: each generation's pixels (an image H x W [x C], a video F x H x W [x C], uint8),
    the records, and each generation's sound (WAV bytes, None from a silent model)."""

    pool: int
    pixels: list[np.ndarray]
    video: bool
    records: Json
    audio: list[bytes | None]
    limits = POOL

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.audio) != len(self.pixels):
            raise WireError(f"{len(self.audio)} sounds for {len(self.pixels)} generations: one each (None: silent)")
        dims = (3, 4) if self.video else (2, 3)
        for p in self.pixels:
            if p.dtype != np.uint8 or p.ndim not in dims or 0 in p.shape or (p.ndim == dims[1] and p.shape[-1] > 4):
                raise WireError(f"{'a video' if self.video else 'an image'} of {p.dtype} {p.shape}: uint8 "
                                f"{'F x ' if self.video else ''}H x W [x C], C at most 4")


@dataclass(frozen=True)
class Failed(Message):
    """A call (or the start-up) failed on the rank: the error as text (its traceback)."""

    pool: int
    error: str
    limits = POOL


@dataclass(frozen=True)
class Note(Message):
    """Rank 0's note at a step's end, its previews as arrays."""

    pool: int
    note: StepNote
    limits = POOL

    def __post_init__(self) -> None:
        super().__post_init__()
        for p in self.note.previews.values():
            if p.dtype != np.uint8 or p.ndim != 3 or p.shape[-1] != 3:
                raise WireError(f"a preview of {p.dtype} {p.shape}: uint8 H x W x 3")


MESSAGES: dict[str, type[Message]] = {cls.__name__: cls for cls in (
    Challenge, Response, Proof, Hello, Beat, Bye, Start, Build, WarmUp, Run, Cancel, Stop, Spawned, Exited, Result,
    Images, Failed, Note)}
ANSWERS = (Result, Images, Failed, Note)  # what a rank's outbox says (rank.py's (rank, ok, value)), as messages


def answer(pool: int, ok: bool | None, value: Any) -> Message:
    """A rank's answer (ok None: a note; False: an error's text) as the message that carries it: a run's pixels
    (PIL images, or a video's PIL frames) as arrays."""
    if ok is None:
        return Note(pool, value)
    if not ok:
        return Failed(pool, str(value))
    if isinstance(value, dict) and "pixels" in value:
        video = any(not isinstance(p, Image.Image) for p in value["pixels"])
        pixels = [np.stack([np.asarray(f) for f in p]) if video else np.asarray(p) for p in value["pixels"]]
        return Images(pool, pixels, video, value["records"], value["audio"])
    return Result(pool, value)


def received(message: Message) -> tuple[bool | None, Any]:
    """An answer message as the pool's (ok, value), pixels as PIL images again."""
    if isinstance(message, Note):
        return None, message.note
    if isinstance(message, Failed):
        return False, message.error
    if isinstance(message, Images):
        pixels = [[Image.fromarray(f) for f in p] if message.video else Image.fromarray(p) for p in message.pixels]
        return True, {"pixels": pixels, "audio": message.audio, "records": message.records}
    assert isinstance(message, Result), message
    return True, message.value


# -- the fields' codec: each value encoded and rebuilt by the type its field declares -----------------------------

@cache
def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of `hint` at its top level (its items are checked as they are encoded or rebuilt)."""
    if hint is Json:
        return True
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)  # an int stays an int
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, origin or hint)


def _items(hint: Any, count: int) -> tuple[Any, ...]:
    """The item types of a list or tuple of `count` items."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list or args[-1:] == (Ellipsis,):
        return (args[0],) * count
    if len(args) != count:
        raise WireError(f"{count} items where {hint} has {len(args)}")
    return args


def _encode(value: Any, hint: Any, arrays: list[np.ndarray]) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for alternative in typing.get_args(hint):
            if _fits(value, alternative):
                return _encode(value, alternative, arrays)
    if not _fits(value, hint):
        raise WireError(f"{type(value).__name__} where {hint} is declared")
    if hint is bytes or hint is np.ndarray:
        array = np.frombuffer(value, np.uint8) if hint is bytes else np.ascontiguousarray(value)
        if array.dtype.name not in DTYPES:
            raise WireError(f"an array of {array.dtype}: the wire carries {', '.join(DTYPES)}")
        arrays.append(array)
        return len(arrays) - 1
    if dataclasses.is_dataclass(hint):
        return {name: _encode(getattr(value, name), h, arrays) for name, h in _fields(hint).items()}
    if origin in (list, tuple):
        return [_encode(v, h, arrays) for v, h in zip(value, _items(hint, len(value)))]
    if origin is dict:
        if not all(isinstance(k, str) for k in value):
            raise WireError(f"a {hint} with keys that are not strings")
        return {k: _encode(v, typing.get_args(hint)[1], arrays) for k, v in value.items()}
    return value


def _decode(value: Any, hint: Any, arrays: list[np.ndarray]) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for alternative in typing.get_args(hint):
            try:
                return _decode(value, alternative, arrays)
            except WireError:
                continue
        raise WireError(f"{type(value).__name__} where {hint} is declared")
    if hint is bytes or hint is np.ndarray:
        if not _fits(value, int) or not 0 <= value < len(arrays):
            raise WireError(f"{value!r} names none of the frame's {len(arrays)} arrays")
        array = arrays[value]
        if hint is bytes and (array.dtype != np.uint8 or array.ndim != 1):
            raise WireError(f"bytes sent as a {array.dtype} array of shape {array.shape}")
        return array.tobytes() if hint is bytes else array
    if dataclasses.is_dataclass(hint):
        declared = _fields(hint)
        if not isinstance(value, dict) or value.keys() != declared.keys():
            raise WireError(f"{hint.__name__} needs exactly the fields {', '.join(declared)}")
        try:
            return hint(**{name: _decode(value[name], h, arrays) for name, h in declared.items()})
        except (TypeError, ValueError) as err:
            raise WireError(f"{hint.__name__}: {err}") from None
    if not _fits(value, hint):
        raise WireError(f"{type(value).__name__} where {hint} is declared")
    if origin in (list, tuple):
        return origin(_decode(v, h, arrays) for v, h in zip(value, _items(hint, len(value))))
    if origin is dict:
        return {k: _decode(v, typing.get_args(hint)[1], arrays) for k, v in value.items()}
    return value


# -- frames ----------------------------------------------------------------------------------------------------

def frame(message: Message) -> list[bytes | memoryview]:
    """The message as one frame: its prefix and header, then each array's bytes."""
    arrays: list[np.ndarray] = []
    fields = {name: _encode(getattr(message, name), hint, arrays) for name, hint in _fields(type(message)).items()}
    try:
        header = json.dumps({"kind": type(message).__name__, "fields": fields,
                             "arrays": [[a.dtype.name, list(a.shape)] for a in arrays]}).encode()
    except (TypeError, ValueError) as err:
        raise WireError(f"{type(message).__name__} holds what JSON does not: {err}") from None
    payload = sum(a.nbytes for a in arrays)
    if len(header) > MAX_HEADER or payload > MAX_PAYLOAD:
        raise WireError(f"{type(message).__name__} is too large: a {len(header)}-byte header, {payload} bytes of "
                        f"arrays (at most {MAX_HEADER} and {MAX_PAYLOAD})")
    return [PREFIX.pack(MAGIC, len(header), payload) + header, *(memoryview(a.reshape(-1).view(np.uint8)) for a in arrays)]


def _layout(arrays: Any) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """The header's array declarations, checked: a known dtype and a shape of non-negative integers each."""
    if not isinstance(arrays, list) or len(arrays) > MAX_ARRAYS:
        raise WireError(f"the arrays must be a list of at most {MAX_ARRAYS}")
    found = []
    for entry in arrays:
        if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in DTYPES or not isinstance(entry[1], list)
                or len(entry[1]) > 8 or not all(_fits(n, int) and n >= 0 for n in entry[1])):
            raise WireError(f"an array must be declared [dtype, shape] (dtype one of {', '.join(DTYPES)}): {entry!r:.80}")
        found.append((np.dtype(entry[0]), tuple(entry[1])))
    return found


def _head(header: bytearray) -> tuple[type[Message], Any, list[tuple[np.dtype, tuple[int, ...]]]]:
    """A frame's header, checked: its message's class, its fields (JSON yet) and its arrays' layout."""
    try:
        head = json.loads(header)
    except (ValueError, RecursionError) as err:
        raise WireError(f"the header is not JSON ({type(err).__name__})") from None
    if not isinstance(head, dict) or head.keys() != {"kind", "fields", "arrays"}:
        raise WireError("the header must hold exactly kind, fields and arrays")
    cls = MESSAGES.get(head["kind"]) if isinstance(head["kind"], str) else None
    if cls is None:
        raise WireError(f"unknown message kind {head['kind']!r:.40}")
    return cls, head["fields"], _layout(head["arrays"])


def _message(cls: type[Message], fields: Any, layout: list[tuple[np.dtype, tuple[int, ...]]],
             payload: bytearray) -> Message:
    """The message a checked header and its payload make (WireError for fields its class does not declare)."""
    arrays, at = [], 0
    for dtype, shape in layout:
        count = math.prod(shape)
        arrays.append(np.frombuffer(payload, dtype, count, at).reshape(shape))
        at += count * dtype.itemsize
    try:
        return _decode(fields, cls, arrays)
    except RecursionError:
        raise WireError(f"{cls.__name__}'s fields nest too deep") from None


class Channel:
    """One end of a join-port connection: whole messages out (from any thread) and in (from one)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: Message) -> None:
        parts = frame(message)
        with self._lock:
            for part in parts:
                self.sock.sendall(part)

    def receive(self, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> Message:
        """The next message (EOFError when the peer closed between frames; WireError for a broken frame)."""
        magic, header_bytes, payload_bytes = PREFIX.unpack(self._read(PREFIX.size, start=True))
        if magic != MAGIC:
            raise WireError(f"not a join-port frame (it starts {magic!r})")
        if header_bytes > max_header or payload_bytes > max_payload:
            raise WireError(f"a frame of a {header_bytes}-byte header and {payload_bytes} bytes of payload: at most "
                            f"{max_header} and {max_payload} here")
        cls, fields, layout = _head(self._read(header_bytes))
        declared = sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout)
        if declared != payload_bytes:
            raise WireError(f"the arrays declare {declared} bytes and the payload is {payload_bytes}")
        return _message(cls, fields, layout, self._read(payload_bytes))

    def expect(self, kind: type[Message]) -> Any:
        """The next message, which must be a `kind` (a handshake step: small, no payload)."""
        message = self.receive(HANDSHAKE_HEADER, 0)
        if not isinstance(message, kind):
            raise WireError(f"{type(message).__name__} where {kind.__name__} was due")
        return message

    def _read(self, count: int, start: bool = False) -> bytearray:
        data = bytearray(count)
        view, got = memoryview(data), 0
        while got < count:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if start and got == 0:
                    raise EOFError("the peer closed the connection")
                raise WireError(f"the peer closed the connection within a frame ({got} of {count} bytes)")
            got += n
        return data

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- the handshake ---------------------------------------------------------------------------------------------

def _proof(secret: bytes | None, role: bytes, first: str, second: str) -> str:
    return hmac.new(secret or b"", b"%s|%s|%s" % (role, first.encode(), second.encode()), hashlib.sha256).hexdigest()


def check_host(channel: Channel, secret: bytes | None) -> None:
    """The front's side: the host proves the secret over the front's nonce, then the front proves it back."""
    ours = secrets.token_hex(NONCE_BYTES)
    channel.send(Challenge(ours))
    response = channel.expect(Response)
    if not hmac.compare_digest(response.proof, _proof(secret, b"host", ours, response.nonce)):
        raise WireError("its proof does not match this job's join secret")
    channel.send(Proof(_proof(secret, b"front", response.nonce, ours)))


def prove_host(channel: Channel, secret: bytes | None) -> None:
    """The host's side: prove the secret over the front's nonce, then check the front's proof."""
    challenge = channel.expect(Challenge)
    ours = secrets.token_hex(NONCE_BYTES)
    channel.send(Response(ours, _proof(secret, b"host", challenge.nonce, ours)))
    proof = channel.expect(Proof)
    if not hmac.compare_digest(proof.proof, _proof(secret, b"front", ours, challenge.nonce)):
        raise WireError("the front's proof does not match this job's join secret")


__all__ = ["ANSWERS", "JOIN_KEY_ENV", "MESSAGES", "Channel", "Message", "WireError", "answer", "check_host",
           "frame", "join_secret", "local_only", "new_secret", "prove_host", "received", "require_secret"]
