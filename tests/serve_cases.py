"""A `streamfusion serve` process for the serve tests: started as a user starts it (port 0), on loopback only,
ready when it prints its `serving ... on http://...` line, and stopped with no process left behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^serving (\S+) on (http://127\.0\.0\.1:\d+) \((.*)\)$")
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; playwright is never let download a browser of its own
START_S = 180.0  # ranks started, pipeline built and warmed (a few seconds on 2 idle cores; CI is slower)


def is_rank(process: psutil.Process) -> bool:
    """A rank process: spawned by its pool (GPU), or forked by the pool's fork server (CPU)."""
    try:
        if "spawn_main" in " ".join(process.cmdline()):
            return True
        parent = process.parent()
        return parent is not None and "forkserver" in " ".join(parent.cmdline())
    except psutil.Error:
        return False


class Server:
    """`python -m streamfusion_diffusers serve --port 0 ARGS`; `url` once ready, `stderr` what it said."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        environment.pop("STREAMFUSION_API_KEY", None)
        environment.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "streamfusion_diffusers", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                                     cwd=ROOT)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        self.url = self.layout = ""
        ends = time.monotonic() + START_S
        for line in self.proc.stdout:
            found = READY.match(line.strip())
            if found:
                self.url, self.layout = found[2], found[3]
                break
            if time.monotonic() > ends:
                break
        if not self.url:
            self.stop(now=True)
            raise RuntimeError("streamfusion serve did not get ready:\n" + self.stderr)
        self.family = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def rss_bytes(self) -> int:
        """Resident memory of the server and every rank."""
        found = 0
        for pid in self.family:
            try:
                found += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return found

    def rank_pids(self) -> list[int]:
        """The ranks now running, in rank order (started in that order; /health shows no pids)."""
        children = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if is_rank(p)]
        return [p.pid for p in sorted(children, key=lambda p: (p.create_time(), p.pid))]

    def left(self) -> list[int]:
        """Processes of this server (it or its ranks, now or started since) still running."""
        pids = set(self.family)
        try:
            pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        return sorted(p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE)

    def stop(self, now: bool = False) -> int:
        """SIGTERM (drain), or SIGKILL with `now`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if now else signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for pid in self.left():  # ranks of a server killed at once end by themselves within a second or two
            psutil.Process(pid).kill()


@contextmanager
def browser_page() -> Iterator:
    """A page of headless Chromium driven by playwright; the test skips, saying why, where either is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium (Debian's package) to run the page test")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser.new_page()
        finally:
            browser.close()
