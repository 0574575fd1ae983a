"""Transformers of the plan families and their forward inputs, as diffusers' pipelines pass them, seeded.

For tests (tiny configs) and real-size timing runs (`benchmarks/models_gpu.py`): every rank builds the same
model and inputs from a config, a token grid and a text length. Latent grids are in tokens (after patching).
Input images (`references`, token grids too) enter as their pipelines put them: their tokens after the image's in
one sequence (Flux.1 Kontext, Flux.2, Qwen-Image-Edit), told apart by position ids or `img_shapes`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from diffusers import (ChronoEditTransformer3DModel, Flux2Transformer2DModel, FluxTransformer2DModel, HeliosTransformer3DModel,
                       HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel, Krea2Transformer2DModel, LongCatImageTransformer2DModel,
                       LTXVideoTransformer3DModel, QwenImageTransformer2DModel, WanTransformer3DModel,
                       ZImageTransformer2DModel)
from diffusers import LTX2VideoTransformer3DModel
from diffusers import MiniMaxH3Transformer3DModel
from diffusers import Cosmos3OmniTransformer

from .build import _default_dtype_and_device
from .configs import JOINT

FAMILIES: dict[str, type] = {"flux": FluxTransformer2DModel, "flux2": Flux2Transformer2DModel, "wan": WanTransformer3DModel,
                             "qwen-image": QwenImageTransformer2DModel, "ltx": LTXVideoTransformer3DModel,
                             "hunyuan-video": HunyuanVideoTransformer3DModel,
                             "chronoedit": ChronoEditTransformer3DModel, "helios": HeliosTransformer3DModel,
                             "longcat-image": LongCatImageTransformer2DModel, "krea2": Krea2Transformer2DModel,
                             "z-image": ZImageTransformer2DModel,
                             "minimax-h3": MiniMaxH3Transformer3DModel,
                             "ltx2": LTX2VideoTransformer3DModel,
                             "cosmos3": Cosmos3OmniTransformer,
                             "hunyuan-video-1.5": HunyuanVideo15Transformer3DModel}


def build(family: str, config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu") -> torch.nn.Module:
    """The family's transformer from `config`, seeded random weights made in place (dtype, device)."""
    torch.manual_seed(seed)
    with _default_dtype_and_device(dtype, device):
        return FAMILIES[family](**config).eval()


def inputs(family: str, config: dict[str, Any], grid: tuple[int, ...], text: int, *, batch: int = 1,
           padded_text: int = 0, token_timesteps: bool = False, references: tuple[tuple[int, int], ...] = (),
           audio: int = 0, seed: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
           ) -> dict[str, Any]:
    """Forward keyword arguments; `padded_text` trailing text tokens of the last batch row are masked out;
    `token_timesteps`: one timestep per latent token (Wan 2.2 TI2V's expand_timesteps; LTX-2's conditioning
    pipelines'), Wan and LTX-2; `audio`: the audio tokens, LTX-2's or MiniMax-H3's (both stereo channels; 0: 4 a
    video frame and one more, a channel); `references`: input images' (rows, cols) token grids after the image's
    tokens (Flux.1, Flux.2, Qwen-Image), before them (Z-Image's omni mode)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, t = batch, text

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    mask = torch.ones(b, t, dtype=torch.long, device=device)
    if padded_text:
        mask[-1, t - padded_text:] = 0
    timestep = torch.rand(b, generator=g, device=device, dtype=dtype) * 1000
    grids = [tuple(grid), *references]  # image tokens, then each input image's
    tokens = sum(r * c for r, c in grids) if references else 0
    if family == "flux":  # Kontext: an input image's ids say 1 where the image's say 0 (FluxKontextPipeline)
        ids = torch.cat([_grid_ids(r, c, first=float(i > 0), device=device) for i, (r, c) in enumerate(grids)])
        return {"hidden_states": randn(b, tokens or grid[0] * grid[1], config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["joint_attention_dim"]),
                "pooled_projections": randn(b, config["pooled_projection_dim"]), "timestep": timestep / 1000,
                "img_ids": ids, "txt_ids": torch.zeros(t, 3, device=device)}
    if family == "flux2":
        rows, cols = grid
        arange = [torch.arange(float(n), device=device) for n in (rows, cols, t)]
        zero = torch.zeros(1, device=device)
        img_ids = torch.cat([torch.cartesian_prod(torch.full((1,), 10.0 * i, device=device),  # Flux2Pipeline's T
                                                  torch.arange(float(r), device=device),
                                                  torch.arange(float(c), device=device), zero)
                             for i, (r, c) in enumerate(grids)])
        txt_ids = torch.cartesian_prod(zero, zero, zero, arange[2])
        return {"hidden_states": randn(b, tokens or rows * cols, config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["joint_attention_dim"]), "timestep": timestep / 1000,
                "img_ids": img_ids.expand(b, -1, -1), "txt_ids": txt_ids.expand(b, -1, -1),
                "guidance": torch.full((b,), 3.5, device=device, dtype=dtype)}
    if family == "qwen-image":
        rows, cols = grid
        return {"hidden_states": randn(b, tokens or rows * cols, config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["joint_attention_dim"]),
                "encoder_hidden_states_mask": mask, "timestep": timestep / 1000,
                "img_shapes": [[(1, r, c) for r, c in grids]] * b}
    if family == "longcat-image":  # text ids count along the text, image ids (1, row, col)
        rows, cols = grid
        return {"hidden_states": randn(b, rows * cols, config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["joint_attention_dim"]), "timestep": timestep / 1000,
                "img_ids": _grid_ids(rows, cols, first=1.0, device=device),
                "txt_ids": torch.arange(float(t), device=device)[:, None].expand(t, 3).contiguous()}
    if family == "krea2":  # Krea2Pipeline: the text's position ids zero, the image's (0, row, col), text first
        rows, cols = grid
        ids = torch.cat([torch.zeros(t, 3, device=device), _grid_ids(rows, cols, first=0.0, device=device)])
        return {"hidden_states": randn(b, rows * cols, config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["num_text_layers"], config["text_hidden_dim"]),
                "timestep": timestep / 1000, "position_ids": ids, "encoder_attention_mask": mask.bool()}
    if family == "z-image" and references:  # omni mode (ZImageOmniPipeline): per batch row the input images'
        # latents then the target's, a caption piece before each and one after, the input images' SigLIP features
        latents = [*references, grid]
        return {"x": [[randn(config["in_channels"], 1, 2 * r, 2 * c) for r, c in latents] for _ in range(b)],
                "t": timestep / 1000,
                "cap_feats": [[randn(t, config["cap_feat_dim"]) for _ in range(len(references) + 2)] for _ in range(b)],
                "siglip_feats": [[*(randn(r, c, config["siglip_feat_dim"]) for r, c in references), None]
                                 for _ in range(b)],
                "image_noise_mask": [[0] * len(references) + [1] for _ in range(b)]}
    if family == "z-image":  # one latent [C, 1, H, W] (2x2 patches) and one caption [T, D] per batch row
        rows, cols = grid
        return {"x": list(randn(b, config["in_channels"], 1, 2 * rows, 2 * cols).unbind(0)), "t": timestep / 1000,
                "cap_feats": [randn(t - (padded_text if i == b - 1 else 0), config["cap_feat_dim"])
                              for i in range(b)]}
    frames, rows, cols = grid
    if family == "cosmos3":  # one packed sequence, no batch: text, then video, sound (0: 4 a frame and one more)
        return _cosmos3(config, grid, t, audio or 4 * frames + 1, randn, g, device)
    if family == "minimax-h3":  # stereo: two channels of audio // 2 tokens each (0: 4 a video frame and one more)
        if audio % 2:
            raise ValueError(f"MiniMax-H3's audio is stereo, one channel after the other: pass an even number of "
                             f"audio tokens, not {audio}")
        return _minimax_h3(config, grid, t, audio // 2 or 4 * frames + 1, b, randn, g, device)
    if family == "ltx":
        return {"hidden_states": randn(b, frames * rows * cols, config["in_channels"]),
                "encoder_hidden_states": randn(b, t, config["caption_channels"]), "timestep": timestep,
                "encoder_attention_mask": mask, "num_frames": frames, "height": rows, "width": cols}
    if family == "ltx2":  # LTX2Pipeline's: video and audio latents, a prompt for each stream with one mask
        video, audio = frames * rows * cols, audio or 4 * frames + 1
        projected = config.get("use_prompt_embeddings", True)  # LTX-2.3's connectors project the prompt already
        widths = [config["caption_channels"]] * 2 if projected else [config["cross_attention_dim"],
                                                                     config["audio_cross_attention_dim"]]
        return {"hidden_states": randn(b, video, config["in_channels"]),
                "audio_hidden_states": randn(b, audio, config["audio_in_channels"]),
                "encoder_hidden_states": randn(b, t, widths[0]),
                "audio_encoder_hidden_states": randn(b, t, widths[1]),
                "timestep": torch.rand(b, video, generator=g, device=device, dtype=dtype) * 1000
                if token_timesteps else timestep, "audio_timestep": timestep, "sigma": timestep,
                "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
                "num_frames": frames, "height": rows, "width": cols, "audio_num_frames": audio}
    latents = randn(b, config["in_channels"], frames, 2 * rows, 2 * cols)  # 2x2 patches
    if family == "hunyuan-video-1.5":  # text-to-video: zero image embeddings (their tokens masked), a ByT5 prompt
        glyphs = torch.ones(b, 3, dtype=torch.long, device=device)
        glyphs[:, 2:] = 0
        return {"hidden_states": latents, "timestep": timestep,
                "encoder_hidden_states": randn(b, t, config["text_embed_dim"]), "encoder_attention_mask": mask,
                "encoder_hidden_states_2": randn(b, 3, config["text_embed_2_dim"]), "encoder_attention_mask_2": glyphs,
                "image_embeds": torch.zeros(b, 2, config["image_embed_dim"], device=device, dtype=dtype)}
    if family in ("wan", "chronoedit", "helios"):
        if token_timesteps:
            timestep = torch.rand(b, frames * rows * cols, generator=g, device=device, dtype=dtype) * 1000
        return {"hidden_states": latents, "timestep": timestep,
                "encoder_hidden_states": randn(b, t, config["text_dim"])}
    return {"hidden_states": latents, "timestep": timestep,
            "encoder_hidden_states": randn(b, t, config["text_embed_dim"]), "encoder_attention_mask": mask,
            "pooled_projections": randn(b, config["pooled_projection_dim"]),
            "guidance": torch.full((b,), 3.5, device=device, dtype=dtype)}


def _minimax_h3(config: dict[str, Any], grid: tuple[int, ...], text: int, per_channel: int, batch: int,
                randn: Callable[..., torch.Tensor], g: torch.Generator, device: torch.device | str) -> dict[str, Any]:
    """MiniMax-H3's packed sequence as its keyframe-to-video-and-audio layout lays it: [text ; the first frame, a
    keyframe at its own noise level ; the audio, its two channels one after the other ; the other frames], every
    row tagged with its modality (0 video, 1 text, 2 audio) and the index of its timestep."""
    frames, rows, cols = grid
    per_frame = rows * cols
    keyframe, audio, video = text, text + per_frame, text + per_frame + 2 * per_channel  # where each starts
    length = video + (frames - 1) * per_frame

    def arange(start: float, stop: float) -> torch.Tensor:
        return torch.arange(float(start), float(stop), device=device)

    ids = torch.zeros(length, 3, device=device)  # (t, h, w): media times continue the text's
    ids[:text, 0] = arange(0, text)
    ids[keyframe:audio] = torch.cartesian_prod(arange(text, text + 1), arange(0, rows), arange(0, cols))
    ids[audio:video, 0] = arange(text, text + per_channel).repeat(2)
    ids[audio + per_channel:video, 2] = cols - 1  # the second channel pinned to the grid's last column
    ids[video:] = torch.cartesian_prod(arange(text + 1, text + frames), arange(0, rows), arange(0, cols))
    video_rows = torch.cat([torch.arange(keyframe, audio, device=device), torch.arange(video, length, device=device)])
    audio_rows = torch.arange(audio, video, device=device)
    tags = torch.ones(length, dtype=torch.long, device=device)
    tags[video_rows], tags[audio_rows] = 0, 2
    noise = torch.rand(3, generator=g, device=device)  # the keyframe's, the audio's, the video's (the text's too)
    row_noise = noise[2].repeat(length)
    row_noise[keyframe:audio], row_noise[audio_rows] = noise[0], noise[1]
    timestep, timestep_indices = torch.unique(row_noise, sorted=True, return_inverse=True)
    patch = math.prod(config.get("patch_size", (1, 2, 2)))
    return {"hidden_states": randn(batch, frames * per_frame, config["in_channels"] * patch),
            "audio_hidden_states": randn(batch, 2 * per_channel, config["audio_in_channels"]),
            "encoder_hidden_states": randn(batch, text, config["text_dim"]), "timestep": timestep,
            "timestep_indices": timestep_indices, "token_tags": tags, "position_ids": ids,
            "video_indices": video_rows, "audio_indices": audio_rows,
            "text_indices": torch.arange(text, device=device)}


def _cosmos3(config: dict[str, Any], grid: tuple[int, ...], text: int, sound: int,
             randn: Callable[..., torch.Tensor], g: torch.Generator, device: torch.device | str) -> dict[str, Any]:
    """Cosmos3's packed sequence as its omni pipeline lays it: [text ; video ; sound ; action], the video's first
    frame a condition (image-to-video: its tokens are no output), the action's first step too; mRoPE position ids
    (t, h, w) with every medium's time after the text's."""
    frames, rows, cols = grid
    video, actions = frames * rows * cols, frames + 1
    start = (text, text + video, text + video + sound, text + video + sound + actions)  # where each begins, the end
    first = min(1, frames - 1)  # the noisy frames: all but the first, where there are two

    def arange(begin: int, stop: int) -> torch.Tensor:
        return torch.arange(begin, stop, device=device)

    def timesteps(n: int) -> torch.Tensor:
        return torch.full((n,), float(torch.rand(1, generator=g, device=device)) * 1000, device=device)

    ids = torch.zeros(3, start[3], device=device)
    ids[:, :text] = arange(0, text)
    ids[:, start[0]:start[1]] = torch.cartesian_prod(arange(0, frames) + text, arange(0, rows), arange(0, cols)).T
    ids[0, start[1]:start[2]] = arange(0, sound) + text
    ids[0, start[2]:start[3]] = arange(1, actions + 1) + text
    vision_rows, action_rows = arange(start[0], start[1]), arange(start[2], start[3])
    return {"input_ids": torch.randint(config["vocab_size"], (text,), generator=g, device=device),
            "text_indexes": arange(0, text), "position_ids": ids, "und_len": text, "sequence_length": start[3],
            "vision_tokens": [randn(1, config["latent_channel"], frames, 2 * rows, 2 * cols)],
            "vision_token_shapes": [(frames, rows, cols)], "vision_sequence_indexes": vision_rows,
            "vision_mse_loss_indexes": vision_rows[first * rows * cols:],
            "vision_timesteps": timesteps((frames - first) * rows * cols),
            "vision_noisy_frame_indexes": [arange(first, frames)],
            "sound_tokens": [randn(config["sound_dim"], sound)], "sound_token_shapes": [(sound, 1, 1)],
            "sound_sequence_indexes": arange(start[1], start[2]), "sound_mse_loss_indexes": arange(start[1], start[2]),
            "sound_timesteps": timesteps(sound), "sound_noisy_frame_indexes": [arange(0, sound)],
            "action_tokens": [randn(actions, config["action_dim"])], "action_token_shapes": [(actions, 1, 1)],
            "action_sequence_indexes": action_rows, "action_mse_loss_indexes": action_rows[1:],
            "action_timesteps": timesteps(actions - 1), "action_noisy_frame_indexes": [arange(1, actions)],
            "action_domain_ids": [torch.ones((), dtype=torch.long, device=device)]}


def _grid_ids(rows: int, cols: int, first: float, device: torch.device | str) -> torch.Tensor:
    """Flux.1's (first, row, col) position ids of a token grid."""
    return torch.cartesian_prod(torch.full((1,), first, device=device), torch.arange(float(rows), device=device),
                                torch.arange(float(cols), device=device))


__all__ = ["FAMILIES", "build", "inputs"]
