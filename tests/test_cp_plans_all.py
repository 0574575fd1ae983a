"""Every diffusers transformer class with a `_cp_plan` runs under `parallelize` in the plan sweep, or is refused.

Swept: a tiny config in tests/plan_cases.py's CONFIGS, whose family names its class (models/inputs.py); its
cases match the unparallelized model on 4 ranks (test_plans_p4.py, test_processors_p4.py). Refused: `plan_for`
names the reason and what a user runs instead (plans.REFUSED). A diffusers release that ships a new planned
transformer fails here until it is one or the other.
"""
from __future__ import annotations

import inspect

import diffusers.models.transformers as transformers
from plan_cases import CONFIGS

from streamfusion_diffusers.diffusers.plans import REFUSED
from streamfusion_diffusers.models.inputs import FAMILIES


def planned() -> set[str]:
    """The transformer classes diffusers ships a context-parallel plan for."""
    return {name for name, cls in inspect.getmembers(transformers, inspect.isclass)
            if getattr(cls, "_cp_plan", None) is not None}


def test_every_transformer_with_a_cp_plan_is_swept_or_refused_naming_what_to_do():
    swept = {FAMILIES[family].__name__ for family in CONFIGS}
    found = planned()
    assert "FluxTransformer2DModel" in found, found  # the listing itself works
    missing = sorted(found - swept - set(REFUSED))
    assert not missing, (f"{missing} ship a diffusers _cp_plan but no tiny case runs them under parallelize: add "
                         f"one to tests/plan_cases.py's CONFIGS (and a Case to test_plans_p4.py), or their reason "
                         f"to plans.REFUSED")
