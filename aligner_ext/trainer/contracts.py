"""Batch contracts: every stage of a step reads only fields the batch starts with or an earlier stage wrote.

Experience makers and wrappers, advantage estimators and losses declare `reads` and `writes`
(ExperienceBatch field names; an instance may extend them from its config, e.g. the loss reads
`ref_logprobs` only with a KL term). `check_stages` runs when the components are built, so a missing
provider fails before anything is generated, naming the field, the plug-in that reads it and the
registered plug-ins that write it. The stages of one step, in order:

    experience maker -> its wrappers, innermost first -> the policy's old-log-prob pass
    -> the reference model (with a KL term) -> advantage estimator -> loss
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aligner_ext.batch import ExperienceBatch
from aligner_ext.errors import ContractError
from aligner_ext.experience.base import EXPERIENCE_MAKERS, EXPERIENCE_WRAPPERS, ExperienceMaker, ExperienceWrapper

# the fields every batch is built with (no default in ExperienceBatch)
BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(ExperienceBatch)
                        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


@dataclass(frozen=True)
class Stage:
    """One step of the loop as the contract sees it."""

    name: str  # how an error names it, e.g. "advantage estimator mtpo_segments"
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def check_stages(stages: list[Stage]) -> None:
    """Raise ContractError at the first field a stage reads that neither the batch's base fields nor an
    earlier stage provide."""
    available = set(BASE_FIELDS)
    for stage in stages:
        for field in stage.reads:
            if field not in ExperienceBatch.__dataclass_fields__:
                raise ContractError(f"{stage.name} declares that it reads {field!r}, which is not an ExperienceBatch field")
            if field not in available:
                raise ContractError(f"{stage.name} reads batch field {field!r}, which no earlier stage of the step "
                                    f"writes; {_providers(field)}")
        available |= set(stage.writes)


def step_stages(maker: ExperienceMaker, with_reference: bool, advantage, advantage_name: str, loss,
                loss_name: str) -> list[Stage]:
    """The stages of one training step, built from the components (module docstring)."""
    chain = [maker]
    while isinstance(chain[-1], ExperienceWrapper):
        chain.append(chain[-1].inner)
    stages = [_maker_stage(part) for part in reversed(chain)]
    stages.append(Stage("the policy's old-log-prob pass", (), ("old_logprobs", "entropy", "staleness")))
    if with_reference:
        stages.append(Stage("the reference model", (), ("ref_logprobs",)))
    stages.append(Stage(f"advantage estimator {advantage_name}", tuple(advantage.reads), ("advantages",)))
    stages.append(Stage(f"loss {loss_name}", tuple(loss.reads), ()))
    return stages


def _maker_stage(part: ExperienceMaker) -> Stage:
    if isinstance(part, ExperienceWrapper):
        name = f"experience wrapper {EXPERIENCE_WRAPPERS.name_of(type(part)) or type(part).__name__}"
    else:
        name = f"experience maker {EXPERIENCE_MAKERS.name_of(type(part)) or type(part).__name__}"
    return Stage(name, tuple(part.reads), tuple(part.writes))


def _providers(field: str) -> str:
    """Which registered makers and wrappers write `field`, as a hint on what to configure."""
    found = [f"experience maker {name} (algorithm.experience_maker)" for name in _first_names(EXPERIENCE_MAKERS)
             if field in EXPERIENCE_MAKERS.get(name).writes]
    found += [f"experience wrapper {name} (in algorithm.experience_wrappers, and switched on)"
              for name in _first_names(EXPERIENCE_WRAPPERS) if field in EXPERIENCE_WRAPPERS.get(name).writes]
    return "it is written by " + " or ".join(found) if found else "no registered plug-in writes it"


def _first_names(registry) -> list[str]:
    """One name per registered plug-in (aliases left out)."""
    return [name for name in registry.names() if registry.name_of(registry.get(name)) == name]
