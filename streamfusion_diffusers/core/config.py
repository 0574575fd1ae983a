"""What the user asks for (ParallelConfig) and the validated layout it resolves to for a given head count."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from .links import parse_link
from .transports import transport_spec

Method = Literal["ulysses", "ring", "usp", "tas", "torus", "auto"]
METHODS: tuple[str, ...] = ("ulysses", "ring", "usp", "tas", "torus")
KERNELS: tuple[str, ...] = ("auto", "reference", "sdpa", "fused", "int8", "fp8")
COMM_DTYPES: tuple[str | None, ...] = (None, "fp8", "int8")
DEFAULT_TIMEOUT_S = 300.0  # how long any collective waits for a peer before it fails (process groups, transports)


def layout_label(method: str, ulysses: int, ring: int, torus: int | None = None) -> str:
    """How tables, recipes and logs name a layout: 'usp U2R4', 'torus U4R2T2' (the torus degree for Torus only)."""
    return f"{method} {degrees_label(ulysses, ring, torus if method == 'torus' else None)}"


def degrees_label(ulysses: int, ring: int, torus: int | None = None) -> str:
    """The degrees of a layout alone, 'U4R2' or 'U4R2T2', where the method is said elsewhere."""
    return f"U{ulysses}R{ring}" + (f"T{torus}" if torus else "")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelConfig:
    """A sequence-parallel layout request: N machines x M GPUs, Ulysses degree U x Ring degree R, a method.

    machines: N. gpus_per_machine: M (None: world size / N). ulysses: U (None: gcd(P, heads) at the first call, or P
    / ring when ring is given). ring: R (None: P / U). torus: T, the part of the Ulysses all-to-all run as Torus
    stages (None: N when N > 1 and N divides U, else gcd(N, U); on one machine, U: Torus inside the machine).
    method: ulysses | ring | usp (Ulysses inside a machine, Ring across) | tas (Ulysses across machines, Ring
    inside) | torus (TAS with Pull Q / Pull KV / Push O stages). backend: how bytes move ("torch":
    torch.distributed's NCCL or gloo; "symm-pull": the same, its even all-to-alls on GPUs one kernel of peer loads
    from symmetric memory; "nvshmem": one-sided puts into symmetric memory; both fall back to "torch" with one
    warning where they cannot run). kernel: local attention ("auto", "reference", "sdpa", "fused"; "int8" or "fp8":
    Q K^T on int8 tensor cores, P V in half precision or (fp8) float8, its log-sum-exp kept, so ring and Torus
    merges stay exact: kernels/quantized_attention.py). native_steps: with a quantized kernel, the (first, last)
    steps of a generation whose attention still runs in the inputs' precision, where quantization errors cost the
    most (ParallelContext.attention_step). timeout_s: the
    longest any collective may wait before it fails instead of hanging. strict: raise instead of falling back when
    the asked-for backend cannot run. emulate_link: make transfers between machines as slow as this link (a preset:
    dgx, p4de, p5, or 'GBPS:LATENCY_US'), so that one host's GPUs, split into `machines` groups, stand in for a
    cluster. method "auto" (the default): the layout (method, U, R, T and the kernel, when kernel is "auto") is chosen
    at the first `sp_attention` call from the attention shape and the cluster, by `choice.choose`: a recipe entry for
    that shape, else the cost model. recipe: where "auto" looks (a packaged name, a YAML file or a folder of them; None:
    the packaged recipes). cfg: classifier-free-guidance parallelism, 1 or 2 branches (world = cfg x SP degree; each
    branch computes one half of the guidance batch over its own SP group) or "auto" (2 when the transformer's first
    batch is 2 and the world splits in two, else 1). comm_dtype: "int8" or "fp8" (float8_e4m3fn) sends every chunk
    that crosses machines (Torus Pull Q, Pull KV, Push O; ring passes) as one byte per value with per-token-and-head
    scales (backends/quantized.py); None sends them as they are. int8 is the more accurate at the same bytes: its
    levels are evenly spaced over each scale, where e4m3 spends bits on an exponent the scale already sets.
    overlap_mlp: Flux.1's single blocks run their MLP projections while the Ulysses all-to-alls travel
    (diffusers/overlap_mlp.py: every GEMM whole), where the attention is pure Ulysses over the torch transport and
    not compiled; True by default, False runs the stock block order. exchange_sms: the SMs that the GEMMs run
    beside an overlapped all-to-all leave free for it (a GEMM that fills every SM holds the exchange's kernels back
    until it ends); 0: none.
    """

    machines: int = 1
    gpus_per_machine: int | None = None
    ulysses: int | None = None
    ring: int | None = None
    torus: int | None = None
    method: Method = "auto"
    backend: str = "torch"
    kernel: str = "auto"
    native_steps: tuple[int, int] = (1, 1)
    timeout_s: float = DEFAULT_TIMEOUT_S
    strict: bool = False
    emulate_link: str | None = None
    recipe: str | None = None
    cfg: int | Literal["auto"] = 1
    comm_dtype: str | None = None
    overlap_mlp: bool = True
    exchange_sms: int = 24

    def __post_init__(self) -> None:
        if self.method not in METHODS + ("auto",):
            raise ValueError(f"method {self.method!r} is not one of {', '.join(METHODS)}, auto")
        if self.method == "auto" and (self.ulysses, self.ring, self.torus) != (None, None, None):
            raise ValueError("method 'auto' chooses ulysses, ring and torus itself: leave them unset, or name a "
                             "method to fix the layout")
        transport_spec(self.backend)  # a name core/transports.py knows
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")
        if (not isinstance(self.native_steps, tuple) or len(self.native_steps) != 2
                or not all(isinstance(n, int) and n >= 0 for n in self.native_steps)):
            raise ValueError(f"native_steps must be two non-negative integers (first, last), got {self.native_steps!r}")
        for name in ("machines", "gpus_per_machine", "ulysses", "ring", "torus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.exchange_sms, int) or self.exchange_sms < 0:
            raise ValueError(f"exchange_sms must be a non-negative integer, got {self.exchange_sms!r}")
        if self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype {self.comm_dtype!r} is not one of None, 'fp8', 'int8'")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.emulate_link is not None:
            parse_link(self.emulate_link)
        if self.cfg not in (1, 2, "auto"):
            raise ValueError(f"cfg must be 1, 2 or 'auto' (the classifier-free-guidance branches), got {self.cfg!r}")

    @property
    def label(self) -> str:
        """Short name such as 'torus U8R1' once both degrees are known, else the method alone."""
        if self.ulysses and self.ring:
            return layout_label(self.method, self.ulysses, self.ring, self.torus)
        return self.method


@dataclass(frozen=True)
class Layout:
    """A resolved layout: P = machines * gpus_per_machine = torus * ulysses_intra * ring, ulysses = T * U'."""

    method: str
    machines: int
    gpus_per_machine: int
    ulysses: int
    ring: int
    torus: int
    # U' = U / T: the Ulysses degree whose all-to-all runs in one piece (inside a machine for Torus); a field set
    # from the others, not a property: every attention call reads it
    ulysses_intra: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ulysses_intra", self.ulysses // self.torus)

    @property
    def world_size(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def ring_inner(self) -> bool:
        """TAS placement (ring peers adjacent, Ulysses strided) rather than USP's (Ulysses peers adjacent)."""
        return self.method in ("tas", "torus")

    @property
    def placement(self) -> Layout:
        """This layout under the one name that every method placing the ranks alike shares, so that they run one
        code path on one mesh (one set of process groups, one kernel choice): with T = 1, ulysses, usp, tas and
        torus at R = 1 are Ulysses, at U = 1 Ring; torus at T = 1 is tas."""
        if self.torus != 1:
            return self
        method = ("ulysses" if self.ring == 1 else "ring" if self.ulysses == 1 else
                  "tas" if self.ring_inner else "usp")
        return self if method == self.method else replace(self, method=method)

    def rank(self, t: int, u: int, r: int) -> int:
        """Global rank of mesh coordinates (torus t, intra-Ulysses u, ring r)."""
        ulysses_index = t * self.ulysses_intra + u
        if self.ring_inner:
            return ulysses_index * self.ring + r
        return r * self.ulysses + ulysses_index

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(t, u, r) of a global rank; the inverse of `rank`."""
        if self.ring_inner:
            ulysses_index, r = divmod(rank, self.ring)
        else:
            r, ulysses_index = divmod(rank, self.ulysses)
        t, u = divmod(ulysses_index, self.ulysses_intra)
        return t, u, r

    @property
    def label(self) -> str:
        """'torus U4R2T2': the layout without its cluster shape (layout_label)."""
        return layout_label(self.method, self.ulysses, self.ring, self.torus)

    @property
    def degrees(self) -> str:
        """'U4R2T2': the label without the method."""
        return self.label.removeprefix(f"{self.method} ")

    def __str__(self) -> str:
        return f"{self.method} {self.machines}x{self.gpus_per_machine} {self.degrees}"


def machine_shape(config: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(N, M) for a world of this size, or a ValueError that says how to make them agree."""
    n = config.machines
    m = config.gpus_per_machine if config.gpus_per_machine is not None else world_size // n
    if n * m != world_size:
        raise ValueError(
            f"world size {world_size} is not machines x gpus_per_machine = {n} x {m} = {n * m}; "
            f"launch {n * m} processes or set machines and gpus_per_machine so their product is {world_size}"
        )
    return n, m


def cfg_shape(machines: int, gpus_per_machine: int, cfg: int) -> tuple[int, int]:
    """(N', M'): the machines x GPUs of each guidance branch's SP group. With an even machine count each branch
    takes half of the machines, so no attention traffic crosses between the halves; otherwise half of each machine."""
    if cfg == 1:
        return machines, gpus_per_machine
    if machines % cfg == 0:
        return machines // cfg, gpus_per_machine
    if gpus_per_machine % cfg == 0:
        return machines, gpus_per_machine // cfg
    raise ValueError(f"cfg={cfg} needs an even number of machines or of GPUs per machine, got {machines} x "
                     f"{gpus_per_machine}; use cfg=1 or launch an even number of processes per machine")


def resolve_layout(config: ParallelConfig, world_size: int, heads: int | None) -> Layout:
    """Check the request against the world and the head count, filling in defaults; errors name the fix."""
    n, m = machine_shape(config, world_size)
    p = world_size
    method = config.method
    if method == "auto":
        raise ValueError("method 'auto' is resolved from the attention shape at the first sp_attention call "
                         "(streamfusion_diffusers.choice.choose); name a method to resolve a layout up front")
    if method == "ulysses":
        u_req, r_req = config.ulysses or p, config.ring or 1
        if (u_req, r_req) != (p, 1):
            raise ValueError(f"method 'ulysses' uses ulysses={p}, ring=1 on {p} ranks (got ulysses={config.ulysses},"
                             f" ring={config.ring}); use method 'usp', 'tas' or 'torus' to mix Ulysses and Ring")
    elif method == "ring":
        u_req, r_req = config.ulysses or 1, config.ring or p
        if (u_req, r_req) != (1, p):
            raise ValueError(f"method 'ring' uses ulysses=1, ring={p} on {p} ranks (got ulysses={config.ulysses},"
                             f" ring={config.ring}); use method 'usp', 'tas' or 'torus' to mix Ulysses and Ring")
    else:
        u_req = config.ulysses
        if u_req is None:
            if config.ring is not None:
                if p % config.ring:
                    raise ValueError(f"ring={config.ring} does not divide {p} ranks; valid ring degrees: {divisors(p)}")
                u_req = p // config.ring
            elif heads is None:
                raise ValueError("ulysses=None is resolved from the head count; pass heads or set ulysses")
            else:
                u_req = math.gcd(p, heads)
        if p % u_req:
            raise ValueError(f"ulysses degree {u_req} does not divide {p} ranks; valid ulysses degrees: {divisors(p)}")
        r_req = config.ring if config.ring is not None else p // u_req
        if u_req * r_req != p:
            raise ValueError(f"ulysses x ring = {u_req} x {r_req} != {p} ranks; choose ulysses from "
                             f"{divisors(p)} and ring = {p} / ulysses")
    if heads is not None and heads % u_req:
        valid = [d for d in divisors(p) if heads % d == 0]
        hint = (f"method 'ulysses' needs the heads divisible by all {p} ranks: use 'usp', 'tas' or 'torus' with "
                f"ulysses in {valid}" if method == "ulysses" else f"valid ulysses degrees for {p} ranks: {valid}")
        raise ValueError(f"ulysses degree {u_req} does not divide the {heads} heads; {hint}")
    torus = 1
    if method == "torus":
        if config.torus is not None:
            torus = config.torus
            if u_req % torus:
                raise ValueError(f"torus degree {torus} does not divide ulysses degree {u_req}; "
                                 f"valid torus degrees: {divisors(u_req)}")
        else:
            torus = math.gcd(n, u_req) if n > 1 else u_req
    elif config.torus not in (None, 1):
        raise ValueError(f"torus={config.torus} only applies to method 'torus' (got method {method!r})")
    return Layout(method=method, machines=n, gpus_per_machine=m, ulysses=u_req, ring=r_req, torus=torus)
