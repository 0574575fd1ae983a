"""The VAE decode split over 3 gloo processes equals diffusers' own tiled decode (same tiles), and differs from
the untiled decode no more than diffusers' tiled decode does; each rank decodes only its share of the tiles."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLFlux2

from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.vae.tiles import TileGrid, share, split_decode, split_vae_decode, unsplit_vae_decode

WORLD = 3


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _vae(family: str) -> torch.nn.Module:
    """Tiny VAEs of the real architectures (8x spatial; CogVideoX 4x temporal), with small diffusers tiles."""
    torch.manual_seed(0)
    if family in ("flux", "flux2"):  # Flux.2's VAE tiles as AutoencoderKL does
        vae = (AutoencoderKL if family == "flux" else AutoencoderKLFlux2)(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,) * 4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=2, sample_size=64)  # latent tiles 8, step 6
    else:
        vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, latent_channels=4,
                                     down_block_types=("CogVideoXDownBlock3D",) * 4,
                                     up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8,) * 4,
                                     layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)
        vae.enable_tiling(tile_sample_min_height=48, tile_sample_min_width=40)  # latent tiles 6 x 5, step 5 x 4
    return vae.eval()


def _latents(family: str, height: int, width: int) -> torch.Tensor:
    shape = (1, 4, 5, height, width) if family == "cogvideox" else (2, 4, height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(height * 100 + width))


def _decode_three_ways(family: str, height: int, width: int) -> dict:
    vae, z = _vae(family), _latents(family, height, width)
    calls: list[int] = []
    vae.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        untiled = _untiled_cogvideox(vae, z) if family == "cogvideox" else type(vae)._decode(vae, z).sample
        tiled = vae.tiled_decode(z).sample
        before = len(calls)
        split = split_decode(vae, z, dist.get_rank(), dist.get_world_size())
        mine = len(calls) - before
        split_vae_decode(vae, dist.get_rank(), dist.get_world_size())
        via_decode = vae.decode(z).sample
        unsplit_vae_decode(vae)
    return {"vs_tiled": relative_error(split, tiled), "tiled_vs_untiled": relative_error(tiled, untiled),
            "split_vs_untiled": relative_error(split, untiled), "via_decode": relative_error(via_decode, split),
            "shape_ok": split.shape == untiled.shape, "decoder_calls": mine, "all_calls": before}


def _untiled_cogvideox(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    vae.use_tiling = False
    try:
        return vae.decode(z).sample
    finally:
        vae.use_tiling = True


@pytest.mark.parametrize(("family", "height", "width"), [("flux", 20, 26), ("flux", 14, 8), ("cogvideox", 8, 10),
                                                            ("flux2", 14, 8)])
def test_split_decode_is_diffusers_tiled_decode(pool, family, height, width):
    results = pool.run(_decode_three_ways, family, height, width)
    grid = TileGrid.of(_vae(family))
    tiles = sum(len(row) for row in grid.origins(height, width))
    assert tiles >= WORLD
    per_tile = results[0]["all_calls"] // tiles  # CogVideoX decodes each tile in frame groups
    for res in results:
        assert res["shape_ok"] and res["vs_tiled"] <= 1e-6 and res["via_decode"] == 0.0, res
        assert res["split_vs_untiled"] <= 1.01 * res["tiled_vs_untiled"] + 1e-6, res
    calls = [res["decoder_calls"] for res in results]
    assert sum(calls) == tiles * per_tile and max(calls) < tiles * per_tile, calls
    print(f"{family} {height}x{width}: {tiles} tiles, split vs tiled {results[0]['vs_tiled']:.1e}, "
          f"tiled vs untiled {results[0]['tiled_vs_untiled']:.2e}")


def test_share_balances_tile_areas():
    areas = [64, 64, 16, 64, 64, 16, 16, 16, 4]
    owner = share(areas, 3)
    assert owner == [0, 1, 1, 2, 0, 2, 1, 2, 1]  # largest first, each to the least loaded rank
    assert [sum(a for a, o in zip(areas, owner) if o == r) for r in range(3)] == [128, 100, 96]
    assert share([5], 3) == [0]


def test_tiles_diffusers_would_stitch_wrongly_are_refused():
    vae = _vae("cogvideox")
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=48)
    with pytest.raises(ValueError, match="overlap rounds evenly"):
        TileGrid.of(vae)
