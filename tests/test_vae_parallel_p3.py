"""The patch-parallel VAE decode over 3 (and 2) gloo processes equals diffusers' untiled decode (float32 rounding),
with uneven bands, for tiny random-weight VAEs of the real architectures (AutoencoderKL as Flux's, with its
mid-block attention; Flux.2's; AutoencoderKLCogVideoX with its causal convolutions and frame batches; Wan 2.1's
and Qwen-Image's causal 3D VAE, decoded frame by frame through its temporal cache, with its per-frame attention;
Wan 2.2's residual, patchified one; LTX-2's, reflection padded, 32x spatial and 8x temporal; HunyuanVideo 1.5's,
replication padded around its convolutions, with its mid-block attention over every frame, causal by frame); a VAE
neither split takes is decoded on one rank, its group's first."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import (AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLFlux2, AutoencoderKLHunyuanVideo15,
                       AutoencoderKLLTX2Video, AutoencoderKLLTXVideo, AutoencoderKLQwenImage, AutoencoderKLWan,
                       AutoencoderTiny)

from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.vae import decode_over_ranks
from streamfusion_diffusers.diffusers.vae.band_split import Bands
from streamfusion_diffusers.diffusers.vae.bands import banded, parallel_decode, unsupported
from streamfusion_diffusers.diffusers.vae.tiles import is_split, split_vae_decode, unsplit_vae_decode
from streamfusion_diffusers.models.pipelines.ltx2 import VIDEO_VAE

WORLD = 3
TOL = 1e-5  # relative: float32 rounding (GroupNorm statistics and halo convolutions sum in another order)


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


WAN = {"base_dim": 8, "dim_mult": [1, 2, 2], "num_res_blocks": 1, "temperal_downsample": [False, True]}
LATENT = {"flux": (2, 4), "flux2": (2, 4), "cogvideox": (1, 4, 5), "wan2.1": (1, 4, 3), "wan2.2": (1, 6, 3),
          "qwenimage": (1, 4, 1), "ltx2": (1, 4, 2), "hunyuanvideo15": (1, 4, 3)}  # batch, channels and latent
# frames; wan: 3 frames go through the causal cache; hunyuanvideo15: 3 frames at once through its causal attention


def _vae(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family in ("flux", "flux2"):
        vae = (AutoencoderKL if family == "flux" else AutoencoderKLFlux2)(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16, 8),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=4, sample_size=64)
    elif family == "cogvideox":
        vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, latent_channels=4,
                                     down_block_types=("CogVideoXDownBlock3D",) * 4,
                                     up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 16, 16, 8),
                                     layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4)
    elif family == "wan2.1":
        vae = AutoencoderKLWan(z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4, **WAN)
    elif family == "wan2.2":  # residual up blocks, 12 = 3 x 2 x 2 channels unpatchified at the end
        vae = AutoencoderKLWan(z_dim=6, decoder_base_dim=12, in_channels=12, out_channels=12, is_residual=True,
                               patch_size=2, latents_mean=[0.0] * 6, latents_std=[1.0] * 6, **WAN)
    elif family == "ltx2":  # the real decoder's layout (reflection padded), narrow
        vae = AutoencoderKLLTX2Video(**{**VIDEO_VAE, "latent_channels": 4, "block_out_channels": (8, 16, 32, 64),
                                        "decoder_block_out_channels": (8, 16, 32), "layers_per_block": (1,) * 5,
                                        "decoder_layers_per_block": (1,) * 4})
    elif family == "hunyuanvideo15":  # 4x spatial, 2x temporal, channels changing at each upsampling
        vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
                                          spatial_compression_ratio=4, temporal_compression_ratio=2)
    else:
        vae = AutoencoderKLQwenImage(z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4, **WAN)
    vae.enable_tiling()  # ignored by the patch-parallel decode: it equals the untiled one
    return vae.eval()


def _latents(family: str, height: int, width: int) -> torch.Tensor:
    shape = (*LATENT[family], height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(height * 100 + width)) * 2 + 0.5


def _untiled(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    vae.use_tiling = False
    try:
        return vae.decode(z).sample
    finally:
        vae.use_tiling = True


def _decode_both(family: str, height: int, width: int) -> dict:
    vae, z = _vae(family), _latents(family, height, width)
    calls: list[int] = []
    vae.decoder.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[-2]))
    with torch.no_grad():
        whole = _untiled(vae, z)
        calls.clear()
        ours = parallel_decode(vae, z, dist.get_rank(), dist.get_world_size()) if height >= WORLD else whole
        band_rows = set(calls)
        decode_over_ranks(vae, dist.get_rank(), dist.get_world_size())
        via_decode = vae.decode(z).sample
        unsplit_vae_decode(vae)
    patched_left = [n for n, m in vae.named_modules() if "forward" in m.__dict__]
    return {"rel": relative_error(ours, whole), "shape_ok": ours.shape == whole.shape,
            "via_decode": float((via_decode - ours).abs().max()), "band_rows": band_rows,
            "patched_left": patched_left, "tiling_kept": vae.use_tiling}


@pytest.mark.parametrize(("family", "height", "width"),
                         [("flux", 11, 9), ("flux", 3, 5), ("flux", 2, 4), ("cogvideox", 8, 6), ("flux2", 7, 5),
                          ("wan2.1", 7, 5), ("wan2.2", 5, 4), ("qwenimage", 8, 6), ("ltx2", 7, 5), ("ltx2", 3, 4),
                          ("hunyuanvideo15", 4, 5), ("hunyuanvideo15", 7, 3)])
def test_patch_parallel_decode_is_the_untiled_decode(pool, family, height, width):
    results = pool.run(_decode_both, family, height, width)
    rows = Bands.even(height, WORLD, 0).rows if height >= WORLD else (height,) * WORLD  # too few: whole
    for rank, res in enumerate(results):
        assert res["shape_ok"] and res["rel"] <= TOL and res["via_decode"] == 0.0, res
        assert res["band_rows"] == {rows[rank]} or height < WORLD, res  # each decoder saw only its own band
        assert res["patched_left"] == [] and res["tiling_kept"], res
    print(f"{family} {height}x{width} bands {rows}: rel diff to untiled {max(r['rel'] for r in results):.1e}")


def _decode_in_a_pair(height: int) -> float | None:
    group = dist.new_group([0, 1])  # every rank creates it; rank 2 then stays out of the decode
    if dist.get_rank() > 1:
        return None
    vae, z = _vae("flux"), _latents("flux", height, 7)
    with torch.no_grad():
        whole = _untiled(vae, z)
        ours = parallel_decode(vae, z, dist.get_rank(), 2, group)
    return relative_error(ours, whole)


def test_two_of_three_ranks_decode_in_their_own_group(pool):
    results = pool.run(_decode_in_a_pair, 5)  # bands of 3 and 2 latent rows
    assert results[2] is None and max(results[:2]) <= TOL, results


def _group_norm_bf16() -> dict:
    """A bf16 band through a patched GroupNorm (its sums-of-powers path) against float32 on the whole image."""
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(4, 16)
    torch.nn.init.normal_(norm.weight)
    whole = torch.randn(2, 16, 3, 10, 6) * 3 + torch.linspace(-4, 6, 10)[:, None]  # rows at dim -2 differ
    bands = Bands.even(10, dist.get_world_size(), dist.get_rank())
    top = sum(bands.rows[:bands.rank])
    with torch.no_grad(), banded(torch.nn.Sequential(norm), bands):
        ours = norm.to(torch.bfloat16)(whole.to(torch.bfloat16)[..., top:top + bands.rows[bands.rank], :])
    exact = torch.nn.functional.group_norm(whole, 4, norm.weight.float(), norm.bias.float(), norm.eps)
    exact = exact[..., top:top + bands.rows[bands.rank], :]
    return {"rel": relative_error(ours.float(), exact), "dtype": ours.dtype}


def test_group_norm_of_a_bf16_band_uses_the_whole_image(pool):
    for res in pool.run(_group_norm_bf16):
        assert res["dtype"] == torch.bfloat16 and res["rel"] <= 4e-3, res  # bf16 rounding of the output


def test_bands_are_even_and_refuse_too_few_rows():
    assert Bands.even(11, 3, 0).rows == (4, 4, 3)
    assert Bands.even(3, 3, 2).rows == (1, 1, 1)
    with pytest.raises(ValueError, match="fewer ranks"):
        Bands.even(2, 3, 0)


def _decode_on_one_rank(ranks: list[int] | None) -> dict | None:
    """An LTX VAE (its decode hands _decode a temb) through decode_over_ranks over `ranks` (None: the job): how
    often each rank's decoder ran."""
    group = dist.new_group(ranks) if ranks else None  # every rank creates it; the others then stay out
    if ranks and dist.get_rank() not in ranks:
        return None
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(latent_channels=4, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                                layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
                                spatio_temporal_scaling=(True, False), decoder_spatio_temporal_scaling=(True, False),
                                decoder_inject_noise=(False,) * 3, upsample_residual=(False,) * 2,
                                upsample_factor=(1, 1), patch_size=1).eval()
    z = torch.randn(1, 4, 2, 5, 4, generator=torch.Generator().manual_seed(5))
    calls: list[int] = []
    vae.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    members = ranks or list(range(dist.get_world_size()))
    with torch.no_grad():
        whole = vae.decode(z).sample
        calls.clear()
        mode = decode_over_ranks(vae, members.index(dist.get_rank()), len(members), group)
        ours = vae.decode(z, return_dict=False)[0]
        unsplit_vae_decode(vae)
    return {"mode": mode, "same": bool(torch.equal(ours, whole)), "decoder_calls": len(calls)}


def test_a_vae_neither_split_takes_is_decoded_on_rank_0_only(pool):
    results = pool.run(_decode_on_one_rank, None)
    assert all(r["mode"] == "one-rank" and r["same"] for r in results), results
    assert [r["decoder_calls"] for r in results] == [1] + [0] * (WORLD - 1), results


def test_a_group_decodes_on_its_own_first_rank_and_broadcasts_from_it(pool):
    """Ranks 1 and 2 of 3: rank 1 (the group's first, not the job's) decodes, and rank 2 receives its result."""
    results = pool.run(_decode_on_one_rank, [1, 2])
    assert results[0] is None and all(r["mode"] == "one-rank" and r["same"] for r in results[1:]), results
    assert [r["decoder_calls"] for r in results[1:]] == [1, 0], results


def test_unsupported_vaes_are_named_and_fall_back_to_the_tile_split():
    vae = _vae("flux")
    assert [unsupported(_vae(f)) for f in LATENT] == [None] * len(LATENT)
    assert "Linear is none of AutoencoderKL" in unsupported(torch.nn.Linear(2, 2))
    vae.decoder.conv_in.padding_mode = "circular"  # the image's top edge padded from its bottom: no band holds both
    assert "conv_in" in unsupported(vae)
    assert decode_over_ranks(vae, 0, 1) == "whole" and not is_split(vae)  # a group of one rank: nothing to share
    split_vae_decode(vae, 0, 1)  # a single rank: no collective is called by installing
    assert is_split(vae)
    unsplit_vae_decode(vae)
    tiny = AutoencoderTiny(encoder_block_out_channels=(8,), decoder_block_out_channels=(8,),
                           num_encoder_blocks=(1,), num_decoder_blocks=(1,), latent_channels=4)
    assert decode_over_ranks(tiny, 0, 1) == "whole" and not is_split(tiny)  # no _decode to take over
