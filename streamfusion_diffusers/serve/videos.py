"""Video jobs as OpenAI's video API shapes them: POST gives a job id at once, GET says how it is getting on
(status queued / in_progress / completed / failed, progress 0-100), GET .../content gives the mp4 (with its sound
track, from a model that makes sound), GET .../content?variant=audio that sound as WAV.

Finished videos are files in a folder of the server's own (removed when it stops). A finished job is forgotten,
its file removed, once it is older than the time to live, or when the finished jobs outnumber `--keep-videos` or
their files outweigh `--keep-video-bytes` (the oldest first), so a long-running server's disk and memory stay
bounded; jobs still queued or running are bounded by the queue.
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.configs import MODELS
from .work import Work


@dataclass(frozen=True)
class Keep:
    """How many finished videos the server keeps, how many bytes of them, and for how long."""

    count: int = 256
    bytes: int = 4 << 30
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for option, value in (("--keep-videos", self.count), ("--keep-video-bytes", self.bytes),
                              ("--video-ttl", self.ttl_s)):
            if value <= 0:
                raise ValueError(f"{option} {value}: must be above 0 (a finished video must be kept until fetched)")

    def said(self) -> str:
        return (f"--keep-videos {self.count} newest, --keep-video-bytes {self.bytes}, --video-ttl {self.ttl_s:g} s "
                f"after it finished")


@dataclass(eq=False)
class VideoJob:
    id: str
    model: str
    work: Work
    created_at: int
    completed_at: int | None = None
    error: dict[str, str] | None = None
    path: Path | None = None
    audio: Path | None = None  # its sound as WAV (None from a silent model)
    record: dict[str, Any] | None = None
    size: int = 0  # bytes of its files
    finished: float | None = None  # time.monotonic() when it completed or failed
    expires_at: int | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.path is not None:
            return "completed"
        return "in_progress" if self.work.started is not None else "queued"

    def progress(self) -> int:
        if self.path is not None:
            return 100
        group = self.work.group
        done = group.progress(self.work.params.id) if group is not None else None
        return min(99, int(100 * done[0] / max(done[1], 1))) if done else 0

    def describe(self) -> dict[str, Any]:
        """The video object (OpenAI's fields, plus what ran once completed)."""
        params = self.work.params
        found = {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                 "progress": self.progress(), "created_at": self.created_at, "completed_at": self.completed_at,
                 "expires_at": self.expires_at, "prompt": params.prompt, "size": params.size,
                 "seconds": f"{MODELS[self.model].seconds_of(params.frames):g}", "error": self.error,
                 "remixed_from_video_id": None}
        if self.record is not None:
            found["streamfusion"] = self.record
        return found


class VideoStore:
    """The server's video jobs, newest last, within `keep`."""

    def __init__(self, keep: Keep = Keep()):
        self.keep = keep
        self.folder = Path(tempfile.mkdtemp(prefix="streamfusion-serve-"))
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()

    def add(self, model: str, work: Work) -> VideoJob:
        job = VideoJob(id=f"video_{secrets.token_hex(12)}", model=model, work=work, created_at=int(time.time()))
        self.jobs[job.id] = job
        self.evict()
        return job

    def get(self, video_id: str) -> VideoJob | None:
        self.evict()
        return self.jobs.get(video_id)

    def listing(self) -> list[VideoJob]:
        """Every job kept, newest first."""
        self.evict()
        return list(reversed(self.jobs.values()))

    async def complete(self, job: VideoJob, mp4: bytes, record: dict[str, Any], audio: bytes | None = None) -> None:
        """Keep a finished video and its sound (WAV bytes, None from a silent model): its files written in a thread
        (a large mp4 would hold the event loop); one deleted meanwhile leaves no file."""
        files = {self.folder / f"{job.id}.mp4": mp4, **({self.folder / f"{job.id}.wav": audio} if audio else {})}
        for path, data in files.items():
            await asyncio.to_thread(path.write_bytes, data)
        if job.id not in self.jobs:
            for path in files:
                path.unlink(missing_ok=True)
            return
        paths = list(files)
        job.path, job.audio = paths[0], paths[1] if audio else None
        job.record, job.size = record, sum(map(len, files.values()))
        self._finished(job)

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        job.error = {"code": code, "message": message}
        self._finished(job)

    def _finished(self, job: VideoJob) -> None:
        job.finished, job.completed_at = time.monotonic(), int(time.time())
        job.expires_at = job.completed_at + int(self.keep.ttl_s)
        self.evict()

    def evict(self) -> None:
        """Forget the finished jobs past the time to live, then the oldest beyond the count and the bytes (the
        newest one stays, however large: its client has yet to fetch it)."""
        now = time.monotonic()
        finished = [j for j in self.jobs.values() if j.finished is not None]
        for job in finished:
            if now - job.finished > self.keep.ttl_s:
                self.forget(job.id)
        finished = [j for j in finished if j.id in self.jobs]
        held = sum(j.size for j in finished)
        for job in finished[:-1]:
            if len(finished) <= self.keep.count and held <= self.keep.bytes:
                break
            self.forget(job.id)
            finished.remove(job)
            held -= job.size

    def forget(self, video_id: str) -> None:
        job = self.jobs.pop(video_id, None)
        for path in (job.path, job.audio) if job is not None else ():
            if path is not None:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["Keep", "VideoJob", "VideoStore"]
