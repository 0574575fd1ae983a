"""LTX-2 (video and audio): diffusers' `_cp_plan` made exact for our attention, the video split, the audio whole.

diffusers' plan sends every attention of the block through its split attention: the audio's self-attention, the
text cross-attentions (their text cut too) and the audio-video cross-attentions, though only the video
self-attention attends the split sequence; it cuts the rotary tables on dim 1, which is the heads of the "split"
rope type ([B, H, N, D/2]; [B, N, D] only for "interleaved"), and leaves the video table of the audio-video
cross-attentions whole. Here each attention is routed by what its queries and keys are: split video over split
video (`sp_attention`), anything over whole tokens (local, exact, no transfer), and the whole audio over the split
video (`split_key_attention`: each rank attends its video keys, the partial outputs merged by log-sum-exp, which
moves the audio's output, not the far longer video keys and values a gather would).
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

from .plan import ModelPlan

_VIDEO_COORDS = ContextParallelInput(split_dim=2, expected_dims=4)  # [B, axes, N_video, 2]

PLAN = ModelPlan(
    cp_plan={
        "": {
            # the video tokens, the one stream split (the audio, a few tokens a second of video, stays whole)
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            # a timestep per video token (the conditioning pipelines') is cut with them; one per batch row stays
            "timestep": ContextParallelInput(split_dim=1, expected_dims=2),
            # the keyframe markers, one per video token, added to them after proj_in
            "video_keyframes_mask": ContextParallelInput(split_dim=1, expected_dims=3),
        },
        # the video coordinates, cut before each video rotary table is built from them: its token dim is the same
        # for both rope types, and the audio-video cross-attentions' video table is cut alike
        "rope": {"coords": _VIDEO_COORDS},
        "cross_attn_rope": {"coords": _VIDEO_COORDS},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),  # the video output; the audio's is whole
    },
    source="streamfusion",
    local_attention=(
        "transformer_blocks.*.attn2",  # split video over the whole text (its mask applied as the model does)
        "transformer_blocks.*.audio_attn1",  # the whole audio over itself
        "transformer_blocks.*.audio_attn2",  # the whole audio over the whole text
        "transformer_blocks.*.audio_to_video_attn",  # split video queries over the whole audio
    ),
    split_key_attention=("transformer_blocks.*.video_to_audio_attn",),  # the whole audio over the split video
    stock_processors=(LTX2PerturbedAttnProcessor,),  # LTX-2.3's blocks are built with it (guidance that skips a
    # self-attention): it ends in dispatch_attention_fn as the default does, and skips alike on every rank
)
