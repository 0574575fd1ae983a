"""LongCat-Image (diffusers has no `_cp_plan` for it): Flux.1's split, as its forward is Flux.1's.

The dual and single blocks attend [text ; image] rows with one rotary table built from `cat(txt_ids, img_ids)`,
so cutting both token streams and both id lists at the forward gives each rank its rows and their table alike;
the image tokens are gathered after `proj_out`. Its processor calls `dispatch_attention_fn`: no adapter.
"""
from diffusers import FluxTransformer2DModel

from .plan import ModelPlan

PLAN = ModelPlan(cp_plan=FluxTransformer2DModel._cp_plan, source="streamfusion")  # Flux.1's, as diffusers ships it
