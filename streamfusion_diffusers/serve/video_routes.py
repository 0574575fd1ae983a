"""The video routes: OpenAI's /v1/videos (create, JSON or a multipart form with the first frame; list; get;
content; delete). A video is a job (videos.py): created at once and queued, polled until it is completed, its mp4
served from disk (and its sound as WAV, `variant=audio`, from a model that makes sound); deleting one stops it where
it is.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from .errors import ApiError
from .protocol import VideoRequest
from .service import Service
from .videos import VideoJob


def video_routes(service: Service) -> APIRouter:
    """The routes of `service`'s video jobs."""
    router = APIRouter()

    @router.post("/v1/videos")
    async def create_video(request: Request) -> dict[str, Any]:
        """JSON, or OpenAI's multipart form (its client's way), read by python-multipart through Starlette's form
        parser: one route taking both cannot declare FastAPI's `Form()` parameters."""
        service.taking()
        await service.planned()
        try:
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                async with request.form(max_files=1, max_fields=32) as form:
                    for name, value in form.multi_items():
                        if isinstance(value, UploadFile) and name != "input_reference":
                            raise ApiError(400, f"{name}: the one file taken is input_reference (the first "
                                                f"frame); send the others as text fields", param=name,
                                           code="invalid_value")
                    fields = {name: await value.read() if isinstance(value, UploadFile) else value
                              for name, value in form.multi_items()}
                    video = VideoRequest.model_validate(fields, strict=False)
            else:
                video = VideoRequest.model_validate_json(await request.body())
        except ValidationError as err:
            raise service.checker.refusal(err.errors(), tuple(VideoRequest.model_fields)) from None
        params = service.checker.video(video)
        request.state.did = f"size={params.size} steps={params.steps} frames={params.frames}"
        job = await service.submit_video(params)
        return job.describe()

    def video_job(video_id: str) -> VideoJob:
        job = service.videos.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id[:80]!r} here: unknown, deleted, or forgotten (this server keeps "
                                f"{service.videos.keep.said()})", param="video_id", code="video_not_found")
        return job

    @router.get("/v1/videos")
    async def list_videos() -> dict[str, Any]:
        data = [job.describe() for job in service.videos.listing()]
        return {"object": "list", "data": data, "has_more": False}

    @router.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> dict[str, Any]:
        return video_job(video_id).describe()

    @router.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> FileResponse:
        job = video_job(video_id)
        if variant not in ("video", "audio"):
            raise ApiError(400, f"variant {variant[:40]!r}: \"video\" (the mp4) and \"audio\" (its sound as WAV) "
                                f"are served", param="variant")
        if job.path is None:
            raise ApiError(409, f"video {video_id} is {job.status}: GET /v1/videos/{video_id} until its status is "
                                f"completed", param="video_id", code="video_not_ready")
        if variant == "video":
            return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")
        if job.audio is None:
            raise ApiError(404, f"video {video_id} has no sound: {job.model} makes silent videos; ask for "
                                f"variant=video", param="variant", code="no_audio")
        return FileResponse(job.audio, media_type="audio/wav", filename=f"{video_id}.wav")

    @router.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict[str, Any]:
        service.delete_video(video_job(video_id))  # a queued or running one is stopped first
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return router


__all__ = ["video_routes"]
