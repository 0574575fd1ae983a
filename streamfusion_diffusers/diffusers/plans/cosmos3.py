"""Cosmos3 (diffusers has no `_cp_plan` for it): the generation tokens split, the text whole on every rank.

The forward packs one sequence [text ; video ; sound ; action] without a batch dim, hands every layer its text
(`und_seq`) and generation (`gen_seq`) rows apart, and after the last layer reads each output at its indexes of
the whole sequence. The text's pathway attends only the text, causally; the generation queries attend the text's
keys and their own, as one softmax (processors/cosmos3.py). Diffusers keeps its own parallelism out of the model,
behind the `_cp_shard_fn` seam, because that packed, GQA, ragged structure fits no declarative `_cp_plan`; ours
is declarative because the text enters our attention as joint rows.
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor

from ..processors.cosmos3 import Cosmos3SPAttnProcessor
from .plan import AfterText, ModelPlan

PLAN = ModelPlan(
    cp_plan={
        # the rotary table of the whole sequence ([1, N, D] rows [text ; generation]): the text's rows whole, for its
        # whole queries and keys, the generation rows cut like the generation tokens
        "rotary_emb": {0: AfterText(split_dim=1, expected_dims=3, split_output=True),
                       1: AfterText(split_dim=1, expected_dims=3, split_output=True)},
        # video, sound and action tokens are one generation stream, cut once at the first layer ([L, D], no batch)
        "layers.0": {"gen_seq": ContextParallelInput(split_dim=0, expected_dims=2)},
        # the generation rows gathered after their final norm: the output heads read them by whole-sequence index
        "norm_moe_gen": ContextParallelOutput(gather_dim=0, expected_dims=2),
    },
    source="streamfusion",
    adapters={Cosmos3AttnProcessor: Cosmos3SPAttnProcessor},  # the causal text pathway stays local, beside ours
    text_whole=True,  # the text's causal pathway needs all of it on every rank, so it stays whole: joint rows
    text_input="und_len",  # the text lies in the packed sequence; the forward takes its length
    image_input="gen_seq",  # the split stream the gathered output holds
)
