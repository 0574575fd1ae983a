"""The xDiT adapter without xfuser: its layout mapping, its refusals, its command line, and its processors
inside tiny Flux / CogVideoX models fed as xfuser feeds them, on 4 gloo processes (with and without CFG)."""
from __future__ import annotations

import pytest
from model_cases import Case
from xdit_cases import restore_through_wrapper, run

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.xdit.__main__ import parse
from streamfusion_diffusers.xdit.layout import XDiTJob, machines_of, parallel_config, refuse_unsupported

WORLD = 4
TOL = 1e-4
FLUX = "FluxTransformer2DModel"
CASES = {
    "flux-text-split": Case("flux", (8, 8), text=8, batch=2),
    "flux-text-whole": Case("flux", (8, 8), text=7, batch=2),
    "cogvideox-text-whole": Case("cogvideox", (2, 8, 8), text=10, batch=2),
    "cogvideox-text-split": Case("cogvideox", (2, 8, 8), text=8, batch=2),
}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def job(worlds, world_size=4, **kw) -> XDiTJob:
    return XDiTJob(model=FLUX, sp_worlds=worlds, world_size=world_size, **kw)


def test_layout_follows_xfusers_degrees_and_the_machines_each_sp_group_spans():
    one = job(((0, 1, 2, 3),), ulysses=2, ring=2)
    assert parallel_config(one, "torus", 2, "torch") == ParallelConfig(
        machines=2, gpus_per_machine=2, ulysses=2, ring=2, method="torus")
    assert parallel_config(one, "usp", 1, "nvshmem", kernel="sdpa") == ParallelConfig(
        machines=1, gpus_per_machine=4, ulysses=2, ring=2, method="usp", backend="nvshmem", kernel="sdpa")
    assert parallel_config(one, "ring", 1, "torch") == ParallelConfig(machines=1, gpus_per_machine=4, method="ring")
    assert parallel_config(one, "torus", 1, "torch", ulysses=4) == ParallelConfig(
        machines=1, gpus_per_machine=4, ulysses=4, method="torus")
    cfg = job(((0, 1), (2, 3)), ulysses=2)  # CFG 2 x SP 2 on 2 machines of 2 GPUs: each branch on one machine
    assert parallel_config(cfg, "torus", 2, "torch") == ParallelConfig(
        machines=1, gpus_per_machine=2, ulysses=2, ring=1, method="torus")
    assert machines_of(range(8), 16, 4) == 2 and machines_of(range(8, 12), 16, 2) == 1
    assert parallel_config(one, "auto", 2, "torch") == ParallelConfig(machines=2, gpus_per_machine=2, method="auto")
    with pytest.raises(ValueError, match="method 'auto' chooses ulysses, ring and torus itself"):
        parallel_config(one, "auto", 2, "torch", ulysses=2)


def test_machine_counts_that_cannot_hold_the_sp_groups_fail_naming_the_fix():
    with pytest.raises(ValueError, match="machines=3 does not divide the job's 4 processes"):
        machines_of((0, 1, 2, 3), 4, 3)
    with pytest.raises(ValueError, match="unevenly on machines of 4 GPUs"):
        machines_of((2, 3, 4, 5, 6, 7), 12, 3)


@pytest.mark.parametrize("field, value, fix", [
    ("pipefusion", 2, "--pipefusion_parallel_degree 2: use 1"),
    ("pipeline_patches", 4, "--num_pipeline_patch 4: use 1"),
    ("tensor_parallel", 2, "--tensor_parallel_degree 2: use 1"),
    ("fast_attn", True, "drop --use_fast_attn"),
    ("fp8_comms", True, "drop --use_fp8_comms"),
    ("vae_workers", 1, "--vae_parallel_size 1: use 0"),
    ("attention_backend", "sage", "drop --attention_backend sage"),
    ("attention_backend", "FLASH_3_FP8", "drop --attention_backend FLASH_3_FP8"),
    ("hybrid_attention", True, "drop --use_hybrid_attn_schedule"),
    ("onediff", True, "drop --use_onediff"),
])
def test_what_we_cannot_stand_in_for_is_refused_naming_what_to_turn_off(field, value, fix):
    with pytest.raises(ValueError, match="turn off") as err:
        refuse_unsupported(job(((0, 1),), 2, **{field: value}))
    assert fix in str(err.value)


def test_exact_attention_backends_are_accepted_and_cfg_is_left_to_xfuser():
    refuse_unsupported(job(((0, 1),), 2, attention_backend="cudnn"))
    refuse_unsupported(job(((0, 1),), 2, attention_backend="FLASH_3"))
    with pytest.raises(ValueError, match="drop cfg= and use xfuser's --use_cfg_parallel"):
        parallel_config(job(((0, 1),), 2), "torus", 1, "torch", cfg=2)


def test_other_models_are_refused():
    with pytest.raises(ValueError, match="PixArtTransformer2DModel.*without streamfusion_diffusers.xdit.enable"):
        refuse_unsupported(XDiTJob(model="PixArtTransformer2DModel", sp_worlds=((0, 1),), world_size=2))


def test_command_line_takes_our_flags_and_leaves_xfusers_to_the_script():
    script, options, rest = parse(["flux_example.py", "--model", "m", "--sf-method", "usp", "--ulysses_degree", "2",
                                   "--sf-machines", "2", "--sf-backend", "nvshmem", "--sf-ring", "2"])
    assert script == "flux_example.py" and rest == ["--model", "m", "--ulysses_degree", "2"]
    assert options == {"method": "usp", "machines": 2, "backend": "nvshmem", "ring": 2}
    assert parse(["x.py", "--sf-method", "auto"])[1] == {"method": "auto", "machines": None, "backend": "torch"}
    with pytest.raises(SystemExit):
        parse(["--sf-method", "torus"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method, machines, cfg", [
    ("ulysses", 1, 1), ("ring", 1, 1), ("usp", 2, 1), ("torus", 2, 1), ("torus", 1, 2), ("ring", 2, 2)])
def test_processors_inside_xfusers_sharding_match_the_unparallelized_model(pool, case, method, machines, cfg):
    for res in pool.run(run, CASES[case], method, machines, cfg):
        assert res["shape"] == res["expected_shape"], res
        assert res["error"] <= TOL, res
        assert res["restored"], res


def test_disable_restores_processors_found_through_a_delegating_wrapper(pool):
    """xfuser's layer wrappers hand unknown attributes to the module they wrap: where a wrapper has no processor
    of its own, disable must leave it without one again (not a copy of the wrapped module's)."""
    for res in pool.run(restore_through_wrapper, CASES["flux-text-whole"]):
        assert res == {"own_after": False, "ours_installed": True, "same_after": True}, res


def test_xfusers_ulysses_and_ring_degrees_are_kept(pool):
    results = pool.run(run, CASES["flux-text-whole"], "usp", 1, 1, xfuser_ulysses=2, xfuser_ring=2)
    assert all(r["layout"] == "usp 1x4 U2R2" and r["error"] <= TOL for r in results), results


@pytest.mark.parametrize("case, machines, cfg, cluster", [
    ("flux-text-whole", 2, 1, "2 x 2"), ("cogvideox-text-split", 1, 2, "1 x 2")])
def test_method_auto_chooses_for_the_cluster_of_one_sp_group(pool, case, machines, cfg, cluster):
    for res in pool.run(run, CASES[case], "auto", machines, cfg):
        assert res["chosen"] and all(f", {cluster}" in why for why in res["chosen"]), res
        assert res["error"] <= TOL and res["restored"], res
