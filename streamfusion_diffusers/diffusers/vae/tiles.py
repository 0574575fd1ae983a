"""The VAE decode split over ranks: diffusers' own tiles, decoded a share per rank, gathered once, then blended.

Every rank of a sequence-parallel job holds the same final latents, and by default each would decode all of
them. Here the tile grid of diffusers' `tiled_decode` (its tile sizes, overlap factors and blending) is cut into
per-rank shares balanced by tile area; each rank decodes its share, one all-gather brings every tile to every
rank, and diffusers' `blend_v` / `blend_h` stitch them. The result is diffusers' tiled decode with the same tile
settings (within float rounding), which differs from the untiled decode as diffusers' tiling always does.
Tiles are spatial only: CogVideoX's causal temporal convolutions carry a cache from frame group to frame group,
so frame groups cannot be decoded independently; each tile still runs diffusers' frame batching.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLFlux2
from diffusers.models.autoencoders.vae import DecoderOutput
from torch import Tensor

logger = logging.getLogger(__name__)

TILED = (AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLCogVideoX)  # the tiled_decode geometries TileGrid reads


@dataclass(frozen=True)
class TileGrid:
    """diffusers' tiled_decode geometry: latent tile size, latent step between tiles, pixel blend and keep sizes."""

    tile: tuple[int, int]
    step: tuple[int, int]
    blend: tuple[int, int]
    keep: tuple[int, int]

    @classmethod
    def of(cls, vae: torch.nn.Module) -> TileGrid:
        """Read the grid from the VAE's tile attributes, as its tiled_decode computes it."""
        if isinstance(vae, AutoencoderKLCogVideoX):
            tile = (vae.tile_latent_min_height, vae.tile_latent_min_width)
            sample = (vae.tile_sample_min_height, vae.tile_sample_min_width)
            factor = (vae.tile_overlap_factor_height, vae.tile_overlap_factor_width)
        elif isinstance(vae, (AutoencoderKL, AutoencoderKLFlux2)):  # the same tiled_decode
            size = vae.tile_sample_min_size
            if isinstance(size, (list, tuple)):
                raise ValueError("split VAE decode needs a square tile: set vae.tile_sample_min_size to an int")
            tile, sample = (vae.tile_latent_min_size,) * 2, (size, size)
            factor = (vae.tile_overlap_factor,) * 2
        else:
            raise ValueError(f"{type(vae).__name__} is not supported; the split decode takes AutoencoderKL (Flux), "
                             f"AutoencoderKLFlux2 or AutoencoderKLCogVideoX; pass vae=False to parallelize to leave "
                             f"it alone")
        step = tuple(int(t * (1 - f)) for t, f in zip(tile, factor))
        blend = tuple(int(s * f) for s, f in zip(sample, factor))
        keep = tuple(s - b for s, b in zip(sample, blend))
        for t, s, st, k in zip(tile, sample, step, keep):
            if k != st * (s // t):  # diffusers would stitch an image of the wrong size: refuse it here
                raise ValueError(f"the VAE tiles ({s} px, {t} latent, overlap factors {factor}) keep {k} px per "
                                 f"tile but step {st * (s // t)} px; pick a tile size whose overlap rounds evenly "
                                 f"(e.g. diffusers' defaults) or pass vae=False")
        return cls(tile, step, blend, keep)

    def origins(self, height: int, width: int) -> list[list[tuple[int, int]]]:
        """Tile origins (latent rows, cols), row by row, as tiled_decode loops over them."""
        return [[(i, j) for j in range(0, width, self.step[1])] for i in range(0, height, self.step[0])]


def share(areas: list[int], ranks: int) -> list[int]:
    """Owner rank of each tile: largest tiles first, each to the least loaded rank (ties to the lowest rank)."""
    load, owner = [0] * ranks, [0] * len(areas)
    for t in sorted(range(len(areas)), key=lambda t: -areas[t]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[t], load[r] = r, load[r] + areas[t]
    return owner


def _all_gather(x: Tensor, world: int, group: dist.ProcessGroup | None) -> list[Tensor]:
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def gather_tiles(mine: list[Tensor], counts: list[int], like: Tensor,
                 group: dist.ProcessGroup | None = None) -> list[list[Tensor]]:
    """Every rank's decoded tiles (counts[r] of them on rank r), on every rank.

    The shapes go first, in a tiny all-gather (a rank with no tile of its own cannot know the decoded frame
    count); then the tiles, zero-padded to the largest, in one all-gather. `like` gives the rank, dtype and device.
    """
    world, slots = len(counts), max(counts)
    shapes = torch.zeros(slots, like.dim(), dtype=torch.long, device=like.device)
    for k, t in enumerate(mine):
        shapes[k] = torch.tensor(t.shape)
    every = torch.stack(_all_gather(shapes, world, group)).tolist()  # [world][slot][dim]
    biggest = [max(s[d] for row in every for s in row) for d in range(like.dim())]
    padded = like.new_zeros(slots, *biggest)
    for k, t in enumerate(mine):
        padded[k][tuple(slice(0, n) for n in t.shape)] = t
    gathered = _all_gather(padded, world, group)
    return [[gathered[r][k][tuple(slice(0, n) for n in every[r][k])] for k in range(counts[r])]
            for r in range(world)]


def _blend(vae: torch.nn.Module, grid: TileGrid, rows: list[list[Tensor]]) -> Tensor:
    """diffusers' tiled_decode stitching: blend each tile into the one above and to the left, keep its core."""
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, grid.blend[0])
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, grid.blend[1])
            result_row.append(tile[..., :grid.keep[0], :grid.keep[1]])
        result_rows.append(torch.cat(result_row, dim=-1))
    return torch.cat(result_rows, dim=-2)


def split_decode(vae: torch.nn.Module, z: Tensor, rank: int, world: int,
                 group: dist.ProcessGroup | None = None) -> Tensor:
    """Decode z over the `world` ranks of `group` (None: the default group), this rank being `rank` in it (every
    rank of the group calls it with the same z): diffusers' tiled decode, split.

    A latent that fits one tile is decoded whole on every rank, as diffusers decodes it untiled.
    """
    grid = TileGrid.of(vae)
    origins = [o for row in grid.origins(*z.shape[-2:]) for o in row]
    if len(origins) == 1:
        return type(vae)._decode(vae, z).sample
    tiles = [z[..., i:i + grid.tile[0], j:j + grid.tile[1]] for i, j in origins]
    owner = share([t.shape[-2] * t.shape[-1] for t in tiles], world)
    ours = [t for t, r in enumerate(owner) if r == rank]
    # tiles are no larger than tile_latent_min_*, so the class's own _decode does not tile them again
    mine = [type(vae)._decode(vae, tiles[t]).sample.to(z.dtype) for t in ours]
    counts = [owner.count(r) for r in range(world)]
    by_rank = gather_tiles(mine, counts, z, group)
    decoded = [by_rank[r][owner[:t].count(r)] for t, r in enumerate(owner)]
    cols = len(grid.origins(*z.shape[-2:])[0])
    return _blend(vae, grid, [decoded[k:k + cols] for k in range(0, len(decoded), cols)])


def split_vae_decode(vae: torch.nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Make `vae.decode` (and so the pipeline's decode) split its tiles over `group`'s ranks (None: the default
    group's), this rank being `rank` of `world` in it.

    Replaces the instance's `_decode`, below diffusers' `decode`: slicing, offload hooks and the return types
    stay diffusers'. Every rank of the group must then decode the same latents together.
    """
    TileGrid.of(vae)  # refuses VAEs it cannot split, naming the fix
    if is_split(vae):
        raise ValueError("this VAE's decode is already split; call unsplit_vae_decode(vae) first")

    def _decode(z: Tensor, return_dict: bool = True) -> DecoderOutput | tuple[Tensor]:
        sample = split_decode(vae, z, rank, world, group)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    vae._decode = _decode
    if rank == 0:
        logger.info("VAE decode split over %d ranks (tiles of %s latent pixels)", world, TileGrid.of(vae).tile)


def is_split(vae: Any) -> bool:
    return "_decode" in getattr(vae, "__dict__", {})


def unsplit_vae_decode(vae: torch.nn.Module) -> None:
    """Undo `split_vae_decode`: the class's own decode again."""
    if not is_split(vae):
        raise ValueError("this VAE's decode is not split")
    del vae._decode


__all__ = ["TILED", "TileGrid", "gather_tiles", "share", "split_decode", "split_vae_decode", "unsplit_vae_decode"]
