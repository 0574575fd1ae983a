"""MiniMax-H3: diffusers' `_cp_plan` as shipped, its text refiner kept local.

The forward packs [text ; keyframe rows ; audio ; video] into one sequence (each modality's rows scattered there by
sequence-wide indices) and runs one self-attention over all of it, so the packed sequence is the one split stream
and no text enters the attention as rows of its own. Why each entry of the plan is exact:
- `transformer_blocks.0`'s `hidden_states`: cut once the packed buffer is built (the indices scattering into it
  address the whole sequence); the blocks pass it on already cut.
- `rope`'s two outputs: one row of angles per packed row, cut with the same slices as the rows.
- every block's `adaln_indices` (a row's timestep x 3 + its token tag): each block reads the forward's whole
  tensor, so each cuts it with the same slices, and every row keeps its own (timestep, modality) modulation.
- `norm_out`'s `timestep_indices`: per row too, cut alike.
- `proj_out` and `audio_proj_out` gathered: the forward picks the video and the audio rows out of both heads'
  outputs by sequence-wide indices, which address only the whole sequence (a rank's own rows of a modality follow
  the tags, no plain split); the heads' outputs are a few channels a row, far less to move than the rows before.
The text refiner attends the text alone, before it is packed: local.
"""
from diffusers import MiniMaxH3Transformer3DModel

from .plan import ModelPlan

PLAN = ModelPlan(MiniMaxH3Transformer3DModel._cp_plan, "diffusers",
                 local_attention=("token_refiner.*",),  # the refiner attends the whole text, before the packing
                 guidance_batch=False)  # guidance-distilled: one prompt a call, its timestep the distinct values
                 # of the packed rows and its layout tensors without a batch dim (nothing the branches could cut)
