"""LTX-2 (`LTX2Pipeline`): video with its sound from one transformer of two streams (video, audio) that attend each
other; a Gemma 3 12B text encoder whose every hidden state the text connectors project for each stream; a 32x
spatial, 8x temporal video VAE; an audio VAE of mel spectrograms and a vocoder that makes 24 kHz stereo.

The call keeps classifier-free guidance only (the video and the audio at the same scale): spatio-temporal and
modality-isolation guidance are off, each a third transformer call per step that the CFG split does not take.
The sound spans frames / fps seconds at the model's 24 fps (`frame_rate`), what the mp4 is written at.

Real size, the Gemma 3 12B (23 GiB in bfloat16) beside the 18.9B transformer (35 GiB), its connectors and VAEs
leave too little of an 80 GB GPU for a 720p video's VAE decode: `encode_first`. The connectors run in the call, on
the transformer's side; the encoding gives the call the prompt's embeddings and mask and, for classifier-free
guidance, the empty negative prompt's. The video VAE decodes patch-parallel (its reflection padding kept at the
frame's edges); the audio VAE and vocoder, a small share of the decode, run whole on every rank.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily

# Lightricks/LTX-2's component configs (diffusers' layout): text_encoder (google/gemma-3-12b-it), connectors, vae;
# its audio_vae and vocoder are the diffusers classes' defaults
GEMMA3_12B_TEXT: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 1024, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}
GEMMA3_12B_VISION: dict[str, Any] = {  # SigLIP so400m at 896 px
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "image_size": 896, "patch_size": 14, "vision_use_head": False,
}
CONNECTORS: dict[str, Any] = {
    "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128, "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0,
    "rope_double_precision": True, "causal_temporal_positioning": False, "rope_type": "split",
    "per_modality_projections": False, "proj_bias": False,
}
VIDEO_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": (256, 512, 1024, 2048),
    "down_block_types": ("LTX2VideoDownBlock3D",) * 4, "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5),
    "spatio_temporal_scaling": (True, True, True, True), "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal"), "upsample_residual": (True, True, True),
    "upsample_factor": (2, 2, 2), "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
    "resnet_norm_eps": 1e-6, "encoder_causal": True, "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}
SCHEDULER: dict[str, Any] = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05,
                             "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1}


def _gemma3_text(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import Gemma3TextConfig, Gemma3TextModel

    return Gemma3TextModel(Gemma3TextConfig(**config, pad_token_id=tokenizer.pad_token_id,
                                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))


class LTX2(PipelineFamily):
    name, pipeline_class, transformer_class = "ltx2", "LTX2Pipeline", "LTX2VideoTransformer3DModel"
    diffusers_cp = False
    encode_first = True
    encoded = ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask")

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.ltx2 import LTX2Pipeline, LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

        from ..tokenizers import gemma_tokenizer

        cfg = spec.transformer
        tok = gemma_tokenizer(spec.max_sequence_length)
        caption, layers = cfg["caption_channels"], 2  # the connectors read every hidden state: layers + 1
        encoder = _gemma3_text(tok, vocab_size=len(tok), hidden_size=caption, intermediate_size=2 * caption,
                               num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=caption // 2, query_pre_attn_scalar=caption // 2, sliding_window=8)
        registers = spec.max_sequence_length // 2  # the registers must tile the padded prompt
        connectors = LTX2TextConnectors(**{
            **CONNECTORS, "caption_channels": caption, "text_proj_in_factor": layers + 1,
            "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": caption // 2,
            "video_connector_num_layers": 1, "video_connector_num_learnable_registers": registers,
            "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": caption // 2,
            "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": registers})
        vae = AutoencoderKLLTX2Video(**{  # the real widths over 32
            **VIDEO_VAE, "latent_channels": cfg["in_channels"], "block_out_channels": (8, 16, 32, 64),
            "decoder_block_out_channels": (8, 16, 32), "layers_per_block": (1,) * 5,
            "decoder_layers_per_block": (1,) * 4})
        # 16 mel bins of 2 channels over 4 in each latent: the transformer's audio_in_channels, 2 x 16 / 4
        mel_bins = 2 * cfg["audio_in_channels"]
        audio_vae = AutoencoderKLLTX2Audio(base_channels=8, latent_channels=2, mel_bins=mel_bins)
        # 240 samples a mel frame (100 a second at 16 kHz): 24 kHz, as the real vocoder's 6 x 5 x 2 x 2 x 2
        vocoder = LTX2Vocoder(in_channels=2 * mel_bins, hidden_channels=32, upsample_kernel_sizes=[12, 10, 16],
                              upsample_factors=[6, 5, 8], resnet_kernel_sizes=[3], resnet_dilations=[[1]])
        return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, audio_vae=audio_vae,
                            text_encoder=encoder, tokenizer=tok, connectors=connectors, vocoder=vocoder,
                            **transformers)

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        tok = pipe.tokenizer
        text = {**GEMMA3_12B_TEXT, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id}
        encoder = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=GEMMA3_12B_VISION,
                                                              mm_tokens_per_image=256))
        return {"text_encoder": encoder, "connectors": LTX2TextConnectors(**CONNECTORS),
                "vae": AutoencoderKLLTX2Video(**VIDEO_VAE), "audio_vae": AutoencoderKLLTX2Audio(),
                "vocoder": LTX2Vocoder()}

    def call_kwargs(self, spec: ModelSpec, frames: int, guidance_scale: float | None,
                    true_cfg_scale: float | None, max_sequence_length: int) -> dict[str, Any]:
        scale = spec.guidance_scale if guidance_scale is None else guidance_scale
        return {"num_frames": frames, "frame_rate": float(spec.fps), "max_sequence_length": max_sequence_length,
                "guidance_scale": scale, "audio_guidance_scale": scale, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                "modality_scale": 1.0, "audio_modality_scale": 1.0}

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> int:
        return 0  # the text enters by cross-attention only

    def audio(self, pipe: Any, result: Any) -> tuple[Any, int]:
        return result.audio, pipe.vocoder.config.output_sampling_rate


FAMILY = LTX2()
