"""Video jobs as OpenAI's video API shapes them: POST gives a job id at once, GET says how it is getting on
(status queued / in_progress / completed / failed, progress 0-100), GET .../content gives the mp4.

Finished videos are files in a folder of the server's own (removed when it stops); beyond `keep` jobs the oldest
finished ones are forgotten, so a long-running server's disk and memory stay bounded.
"""
from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.output import FPS
from .work import Work


@dataclass(eq=False)
class VideoJob:
    id: str
    model: str
    work: Work
    created_at: int
    completed_at: int | None = None
    error: dict[str, str] | None = None
    path: Path | None = None
    record: dict[str, Any] | None = None

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
                 "expires_at": None, "prompt": params.prompt, "size": params.size,
                 "seconds": f"{(params.frames - 1) / FPS:g}", "error": self.error, "remixed_from_video_id": None}
        if self.record is not None:
            found["streamfusion"] = self.record
        return found


class VideoStore:
    """The server's video jobs, newest last."""

    def __init__(self, keep: int = 256):
        self.keep = keep
        self.folder = Path(tempfile.mkdtemp(prefix="streamfusion-serve-"))
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()

    def add(self, model: str, work: Work) -> VideoJob:
        job = VideoJob(id=f"video_{secrets.token_hex(12)}", model=model, work=work, created_at=int(time.time()))
        self.jobs[job.id] = job
        finished = [j for j in self.jobs.values() if j.status in ("completed", "failed")]
        for old in finished[:max(0, len(self.jobs) - self.keep)]:
            self.forget(old.id)
        return job

    def get(self, video_id: str) -> VideoJob | None:
        return self.jobs.get(video_id)

    def complete(self, job: VideoJob, mp4: bytes, record: dict[str, Any]) -> None:
        path = self.folder / f"{job.id}.mp4"
        path.write_bytes(mp4)
        job.path, job.record, job.completed_at = path, record, int(time.time())

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        job.error, job.completed_at = {"code": code, "message": message}, int(time.time())

    def forget(self, video_id: str) -> None:
        job = self.jobs.pop(video_id, None)
        if job is not None and job.path is not None:
            job.path.unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["VideoJob", "VideoStore"]
