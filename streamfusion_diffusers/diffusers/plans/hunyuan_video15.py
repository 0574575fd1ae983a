"""HunyuanVideo 1.5 (diffusers has no `_cp_plan` for it): HunyuanVideo's split, with the padding of its text dropped.

Attention sees [video ; text] rows (text last); the rotary table (cos, sin: [N_video, D], from `rope`) is cut with
the video. The forward packs the image, ByT5 and MLLM tokens into one text stream, each row's valid tokens first,
and masks the rest as queries and keys (text-to-video masks every image token): no valid query attends them, so
the columns no batch row keeps are dropped with their tokens before the cut (`KeptText`), and what is left is a
mask that keeps every key (rows of unequal valid lengths leave a per-query mask, which the split refuses).
"""
import dataclasses

from .hunyuan_video import PLAN as HUNYUAN_VIDEO
from .plan import KeptText

PLAN = dataclasses.replace(
    HUNYUAN_VIDEO,
    cp_plan={**HUNYUAN_VIDEO.cp_plan,
             "transformer_blocks.*": {"attention_mask": KeptText(split_dim=1, expected_dims=2)}},
    key_masks=(),  # the mask left after KeptText keeps every key
)
