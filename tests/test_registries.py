"""The two registries a contributor adds to: a transport added through core/transports.py and
backends.register_builder alone is taken by the config, by `--backend` and built by the factory; a model family
added through models/configs.py's register_model alone is a `--model` choice, builds from its tiny config and
has its plan. Nothing else is edited for either."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamfusion_diffusers.backends import BUILDERS, TorchTransport, make_transport, register_builder
from streamfusion_diffusers.choice.recipe import PACKAGED
from streamfusion_diffusers.cli import make_parser
from streamfusion_diffusers.core.config import ParallelConfig
from streamfusion_diffusers.core.transports import TRANSPORTS, TransportSpec, register_transport, transport_spec
from streamfusion_diffusers.models import FAMILIES, MODELS, TINY, TINY_FLUX, ModelFamily, ModelSpec, register_model


class ToyTransport(TorchTransport):
    """The gloo transport under a name of its own."""

    name = kind = "toy"


@pytest.fixture
def toy_transport() -> Iterator[TransportSpec]:
    spec = register_transport(TransportSpec("toy", "a test's own transport", aliases=("toy-alias",),
                                            process_groups=("gloo",), overlap=False))
    register_builder("toy", lambda strict, timeout_s: ToyTransport())
    yield spec
    del TRANSPORTS["toy"], BUILDERS["toy"]


@pytest.fixture
def toy_model() -> Iterator[ModelFamily]:
    """Tiny Flux's classes under a family and model name of their own."""
    family = register_model(ModelFamily(
        "toy-flux", "FluxTransformer2DModel", pipeline="flux",
        models={"tiny-toy": ModelSpec("toy-flux", TINY_FLUX, 32, 32, 1, 2, 16, 3.5, vae_scale=2),
                "toy": ModelSpec("toy-flux", TINY_FLUX, 64, 64, 1, 2, 16, 3.5, vae_scale=2)},
        tiny={"toy": "tiny-toy"}))
    yield family
    del FAMILIES["toy-flux"], MODELS["tiny-toy"], MODELS["toy"], TINY["toy"]


def test_a_registered_transport_is_taken_by_the_config_and_the_cli_and_built_by_the_factory(toy_transport):
    assert ParallelConfig(backend="toy").backend == "toy" and transport_spec("toy-alias") is toy_transport
    args = make_parser().parse_args(["generate", "--backend", "toy"])
    assert args.backend == "toy"
    assert type(make_transport("toy")) is ToyTransport and type(make_transport("toy-alias")) is ToyTransport
    assert not transport_spec(make_transport("toy").kind).overlap


def test_an_unknown_transport_is_one_line_naming_the_known_ones(toy_transport):
    with pytest.raises(ValueError, match=r"backend 'mpi' is not one of torch, nccl, gloo, .*toy, toy-alias"):
        ParallelConfig(backend="mpi")
    with pytest.raises(ValueError, match=r"the name\(s\) toy are taken"):
        register_transport(TransportSpec("toy", "again"))
    register_transport(TransportSpec("toy-unbuilt", "no builder"))
    try:
        with pytest.raises(ValueError, match=r"has no builder: add one with .*register_builder\('toy-unbuilt'"):
            make_transport("toy-unbuilt")
    finally:
        del TRANSPORTS["toy-unbuilt"]


def test_a_registered_model_is_a_model_choice_and_builds_from_its_tiny_config(toy_model):
    from streamfusion_diffusers.diffusers.plans import plan_for
    from streamfusion_diffusers.models.build import build_pipeline
    from streamfusion_diffusers.models.pipelines import family_of
    from streamfusion_diffusers.runtime.job import make_job

    args = make_parser().parse_args(["generate", "--model", "tiny-toy", "--cpu"])
    job = make_job(args)
    assert (job.model, job.height, job.steps) == ("tiny-toy", 32, 2)
    pipe = build_pipeline("tiny-toy")
    assert type(pipe).__name__ == family_of("tiny-toy").pipeline_class == "FluxPipeline"
    assert pipe.transformer.config.num_attention_heads == TINY_FLUX["num_attention_heads"]
    assert plan_for(pipe.transformer).source == "diffusers"


def test_the_registry_refuses_a_clash_in_one_line(toy_model):
    with pytest.raises(ValueError, match=r"models \['tiny-toy'\] are taken"):
        register_model(ModelFamily("toy-2", "FluxTransformer2DModel", pipeline="flux",
                                   models={"tiny-toy": ModelSpec("toy-2", TINY_FLUX, 32, 32, 1, 2, 16, 3.5,
                                                                 vae_scale=2)}))
    with pytest.raises(ValueError, match="one plan per transformer class"):
        register_model(ModelFamily("toy-3", "FluxTransformer2DModel", plan="cogvideox"))
    assert "toy-2" not in FAMILIES and "toy-3" not in FAMILIES


def test_every_packaged_recipe_is_named_by_a_family_and_every_named_one_is_packaged():
    files = sorted(p.name.removesuffix(".yaml") for p in PACKAGED.iterdir() if p.name.endswith(".yaml"))
    named = sorted(name for family in FAMILIES.values() for name in family.recipes)
    assert files == named, "name each choice/recipes/*.yaml in its family's recipes= (models/configs.py)"
