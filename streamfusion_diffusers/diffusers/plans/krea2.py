"""Krea-2 (diffusers has no `_cp_plan` for it): the image tokens split, the text whole on every rank.

The forward fuses the text (its own blocks attend the whole text: local), concatenates [text ; image] itself
and, after the last block, keeps the rows past the whole text's length; so the text stays whole (joint rows in
front), the image tokens are cut at the forward, and the rotary table's `position_ids` ([text ; image] rows) keep
their text rows and cut the image's. The output projection (`final_layer`) is gathered. The text mask joins the
image's ones inside the forward, so a padded prompt reaches the attention as a key mask over these same rows.
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .plan import AfterText, ModelPlan

PLAN = ModelPlan(
    cp_plan={
        "": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            "position_ids": AfterText(split_dim=0, expected_dims=2),
        },
        "final_layer": ContextParallelOutput(gather_dim=1, expected_dims=3),
    },
    source="streamfusion",
    local_attention=("text_fusion.*",),  # the text fusion attends the whole text, before the image joins it
    key_masks=("encoder_attention_mask",),
    drop_full_masks=True,
    text_whole=True,
)
