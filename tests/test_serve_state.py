"""What a long-running server keeps: finished video jobs within --keep-videos, --keep-video-bytes and
--video-ttl, their files removed when they are forgotten (the store itself, on real Work items)."""
from __future__ import annotations

import asyncio
import time

from streamfusion_diffusers.runtime.request import Request
from streamfusion_diffusers.serve.videos import Keep, VideoStore
from streamfusion_diffusers.serve.work import Work

REQUEST = Request(prompt="waves", negative_prompt=None, height=64, width=64, frames=9, steps=2, seed=0,
                  guidance_scale=None)


async def finished(store: VideoStore, size: int, fail: bool = False):
    job = store.add("tiny-wan", Work("video", REQUEST, deadline=time.monotonic() + 60))
    job.work.started = time.monotonic()
    if fail:
        store.fail(job, "rank_failed", "a rank died")
    else:
        await store.complete(job, b"\0" * size, {})
    return job


def run(body):
    async def main():
        store = VideoStore(Keep(count=3, bytes=1000, ttl_s=0.5))
        try:
            await body(store)
        finally:
            store.close()
    asyncio.run(main())


def test_beyond_the_count_the_oldest_finished_are_forgotten_and_their_files_removed():
    async def body(store):
        jobs = [await finished(store, 10) for _ in range(5)]
        assert [j.id for j in store.listing()] == [j.id for j in reversed(jobs[2:])]
        assert not jobs[0].path.exists() and not jobs[1].path.exists() and jobs[4].path.exists()
        assert sorted(p.name for p in store.folder.iterdir()) == sorted(f"{j.id}.mp4" for j in jobs[2:])
        running = store.add("tiny-wan", Work("video", REQUEST, deadline=time.monotonic() + 60))
        assert store.get(running.id) is running and len(store.jobs) == 4  # a queued job is not finished: kept
    run(body)


def test_beyond_the_bytes_the_oldest_files_go_and_the_newest_stays():
    async def body(store):
        a, b = await finished(store, 400), await finished(store, 400)
        c = await finished(store, 400)  # 1200 > 1000: a goes
        assert store.get(a.id) is None and not a.path.exists() and store.get(b.id) is b
        huge = await finished(store, 5000)  # alone beyond the bytes: the others go, it stays to be fetched
        assert [j.id for j in store.listing()] == [huge.id] and not c.path.exists() and huge.path.exists()
    run(body)


def test_past_the_time_to_live_a_finished_video_is_forgotten():
    async def body(store):
        done, failed = await finished(store, 10), await finished(store, 0, fail=True)
        assert done.expires_at == done.completed_at and store.get(failed.id) is failed  # ttl 0.5 s rounds to 0
        time.sleep(0.6)
        assert store.get(done.id) is None and store.get(failed.id) is None and not done.path.exists()
    run(body)


def test_a_video_deleted_while_its_file_is_written_leaves_no_file():
    async def body(store):
        job = store.add("tiny-wan", Work("video", REQUEST, deadline=time.monotonic() + 60))
        writing = asyncio.create_task(store.complete(job, b"\0" * 10, {}))  # the file is written in a thread
        store.forget(job.id)  # DELETE /v1/videos/{id} before the write ends
        await writing
        assert store.get(job.id) is None and job.path is None and list(store.folder.iterdir()) == []
    run(body)
