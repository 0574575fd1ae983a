"""The band split of the patch-parallel VAE decode: which latent rows each rank holds, and the transfers
between bands (halo rows, with a causal convolution's cache frames; the whole image, gathered).

Shared by the band rules (`band_rules.py`, one per layer kind) and the strategy that runs them (`bands.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def stacked(x: Tensor, before: Tensor | None, rows: slice) -> Tensor:
    """Those rows of x, after those of the frames `before` it (dim 2) when there are such frames."""
    return x[..., rows, :] if before is None else torch.cat([before[..., rows, :], x[..., rows, :]], dim=2)



@dataclass(frozen=True)
class Bands:
    """Latent rows of each rank's band (top to bottom), this rank, and the group the bands are spread over."""

    rows: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def even(cls, height: int, world: int, rank: int, group: dist.ProcessGroup | None = None) -> Bands:
        """Bands as even as the height allows (the first height % world bands one row taller)."""
        if height < world:
            raise ValueError(f"a latent {height} rows high cannot be cut into {world} bands; decode it on fewer "
                             f"ranks or with the tile split (streamfusion_diffusers.diffusers.vae.tiles.split_vae_decode)")
        return cls(tuple(height // world + (r < height % world) for r in range(world)), rank, group)

    def scaled(self, x: Tensor) -> list[int]:
        """Every band's rows at x's resolution (x is this rank's band, height at dim -2, upsampled k times)."""
        scale, rest = divmod(x.shape[-2], self.rows[self.rank])
        if rest:
            raise ValueError(f"a band of {x.shape[-2]} rows is no multiple of the latent band's "
                             f"{self.rows[self.rank]}: the decoder resizes by a non-integer factor")
        return [r * scale for r in self.rows]

    def all_gather(self, x: Tensor) -> list[Tensor]:
        out = [torch.empty_like(x) for _ in self.rows]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def gather_rows(self, x: Tensor) -> Tensor:
        """The whole image from every rank's band (dim -2), zero-padded to the tallest band for the all-gather."""
        rows = self.scaled(x)
        padded = F.pad(x, (0, 0, 0, max(rows) - x.shape[-2]))
        return torch.cat([part[..., :n, :] for part, n in zip(self.all_gather(padded), rows)], dim=-2)

    def neighbours(self, x: Tensor, pad: int,
                   before: Tensor | None = None) -> Callable[[], tuple[Tensor | None, Tensor | None]]:
        """Start fetching the `pad` rows just above and just below x's band; the returned call waits for them
        (None at the image's top / bottom edge). The fetch runs while the band's own convolution does. With
        `before` (frames that precede x's in time, dim 2: a causal convolution's cache) their rows come too,
        stacked before x's as `stacked` stacks them."""
        if min(self.scaled(x)) < pad:
            raise ValueError(f"a band of {min(self.scaled(x))} rows cannot lend a {pad}-row halo; use fewer ranks")
        mine = torch.cat([stacked(x, before, slice(None, pad)), stacked(x, before, slice(-pad, None))], dim=-2)
        edges = [torch.empty_like(mine) for _ in self.rows]
        work = dist.all_gather(edges, mine, group=self.group, async_op=True)

        def arrived() -> tuple[Tensor | None, Tensor | None]:
            work.wait()
            above = edges[self.rank - 1][..., pad:, :] if self.rank > 0 else None
            below = edges[self.rank + 1][..., :pad, :] if self.rank + 1 < len(self.rows) else None
            return above, below

        return arrived


__all__ = ["Bands", "stacked"]
