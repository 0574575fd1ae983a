"""Qwen-Image and Qwen-Image-Edit: diffusers' `_cp_plan` as shipped, with the text mask as a key mask.

`encoder_hidden_states_mask` masks the text keys of the split self-attention; one that keeps every key is
dropped, so the forward reads nothing of it back to the host (which a CUDA-graph capture could not).
"""
from diffusers import QwenImageTransformer2DModel

from .plan import ModelPlan

PLAN = ModelPlan(QwenImageTransformer2DModel._cp_plan, "diffusers", key_masks=("encoder_hidden_states_mask",),
                 drop_full_masks=True)
