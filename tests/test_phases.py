"""PhaseTimer on a tiny pipeline in one process: each phase measured where it happens, the pipeline left as it was."""
from __future__ import annotations

import time

import torch

from streamfusion_diffusers.runtime.phases import PHASES, PhaseTimer
from streamfusion_diffusers.models.build import build_pipeline


def test_phases_of_a_flux_call_add_up_and_the_pipeline_is_restored():
    pipe = build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    decode = pipe.vae.decode
    pipe.vae.decode = lambda *a, **k: (time.sleep(0.2), decode(*a, **k))[1]  # a decode that takes >= 0.2 s
    slow_decode = pipe.vae.decode
    timer = PhaseTimer(torch.device("cpu"))
    kwargs = dict(prompt="a cat", height=64, width=64, num_inference_steps=2, output_type="np")
    with torch.inference_mode():
        timer.call(pipe, **kwargs)
        after_one = dict(timer.seconds)
        timer.call(pipe, output_type="latent", **{k: v for k, v in kwargs.items() if k != "output_type"})
    s = timer.seconds
    assert set(s) == set(PHASES)
    assert after_one["decode"] >= 0.2 and all(after_one[p] > 0 for p in PHASES), after_one
    assert after_one["total"] >= after_one["text_encoding"] + after_one["denoising"] + after_one["decode"]
    assert s["decode"] == after_one["decode"]  # the latent call never decoded
    assert s["denoising"] > after_one["denoising"] and s["total"] > after_one["total"]
    assert pipe.vae.decode is slow_decode and "encode_prompt" not in pipe.__dict__
    assert not pipe.transformer._forward_pre_hooks and not pipe.transformer._forward_hooks
