"""Where a generation's time goes: text encoding, denoising, VAE decode and the whole call, per pipeline call.

A user waits for all of it, not for one layer. `PhaseTimer.attach(pipe)` wraps the pipeline's `encode_prompt`
and `vae.decode` and hooks the transformer(s). On GPUs each mark is a CUDA event recorded on the current stream,
and the events are read once, after the call: the host never waits for the device inside a step (a
synchronize per transformer call would make host and GPU time add up instead of overlapping), and a phase is
still the time its kernels took, not the time to queue them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Union

import torch

PHASES = ("text_encoding", "denoising", "decode", "total")
Mark = Union[float, torch.cuda.Event]  # perf_counter seconds on the CPU, a recorded event on GPUs


class PhaseTimer:
    """Seconds per phase of the pipeline calls made while attached (phases summed over calls).

    text_encoding: every `encode_prompt` call (Flux with true CFG makes two). denoising: from the first
    transformer call's start to the last one's end, scheduler steps between them included. decode: every
    `vae.decode` call. total: the whole `pipe(...)` call, measured by `call`, which also keeps the last call's
    per-step latencies (`step_latencies`: first transformer call to the first step's end, then step end to
    step end).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.step_latencies: list[float] = []
        self._spans: list[tuple[str, Mark, Mark]] = []  # (phase, start, end) of the call being timed
        self._denoise: list[Mark] = []  # [start of the first transformer call, end of the latest one]
        self._step_ends: list[Mark] = []

    def now(self) -> float:
        """Seconds on the host clock once the device has finished what was queued (one synchronize)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> Mark:
        """A point in the device's timeline, without waiting for it."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _between(start: Mark, end: Mark) -> float:
        if isinstance(start, float):
            return end - start  # type: ignore[operator]
        return start.elapsed_time(end) / 1e3  # type: ignore[arg-type]

    def _timed(self, phase: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.mark()
            out = fn(*args, **kwargs)
            self._spans.append((phase, start, self.mark()))
            return out

        return timed

    def _transformer_start(self, *_: Any) -> None:
        if not self._denoise:
            self._denoise = [self.mark(), self.mark()]

    def _transformer_end(self, *_: Any) -> None:
        self._denoise[1] = self.mark()

    @contextmanager
    def attach(self, pipe: Any) -> Iterator[PhaseTimer]:
        """Time the phases of the pipeline calls made inside the block; the pipeline is left as it was."""
        wrapped = [(pipe, "encode_prompt", "text_encoding"), (pipe.vae, "decode", "decode")]
        saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in wrapped]
        for obj, name, phase in wrapped:
            setattr(obj, name, self._timed(phase, getattr(obj, name)))
        transformers = [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]
        handles = [h for t in transformers for h in (t.register_forward_pre_hook(self._transformer_start),
                                                      t.register_forward_hook(self._transformer_end))]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for obj, name, previous in saved:
                if previous is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, previous)

    def call(self, pipe: Any, **kwargs: Any) -> Any:
        """pipe(**kwargs) with its phases added to `seconds` and its steps in `step_latencies`; the marks are
        read after the call, which ends with the one synchronize of the call."""
        self._spans, self._denoise, self._step_ends = [], [], []
        user_callback = kwargs.pop("callback_on_step_end", None)

        def step_end(pipe_: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
            self._step_ends.append(self.mark())
            return user_callback(pipe_, step, timestep, callback_kwargs) if user_callback else callback_kwargs

        with self.attach(pipe):
            start = self.now()
            out = pipe(**kwargs, callback_on_step_end=step_end)
            self.seconds["total"] += self.now() - start
        for phase, begin, end in self._spans:
            self.seconds[phase] += self._between(begin, end)
        if self._denoise:
            self.seconds["denoising"] += self._between(*self._denoise)
            marks = [self._denoise[0], *self._step_ends]
            self.step_latencies = [self._between(a, b) for a, b in zip(marks, marks[1:])]
        return out


__all__ = ["PHASES", "PhaseTimer"]
