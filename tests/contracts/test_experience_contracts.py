"""Every experience maker and wrapper, built from every shipped variant and documented combination on the
tiny model: the batch contracts hold (trainer/contracts.py runs while building), one step of experience
is well formed (shapes, masks, whole groups, every declared field set) and the maker's state survives a
round trip. A new maker or wrapper must appear in one of the cases."""

import copy

import pytest
import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.config import load_config
from aligner_ext.experience.base import EXPERIENCE_MAKERS, EXPERIENCE_WRAPPERS, ExperienceWrapper
from aligner_ext.trainer.build import build_components
from aligner_ext.trainer.contracts import BASE_FIELDS

TINY = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.warmup.steps=2", "model.warmup.batch_size=4",
    "data.builtin_train_size=16", "data.builtin_val_size=4", "data.train_batch_size=2", "rollout.n=4",
    "rollout.max_response_length=12", "reward.num_workers=1", "trainer.progress_bar=false",
]
MTPO_SIZES = ["mtpo.num_confidence_generations=2", "mtpo.max_answer_length=12", "mtpo.max_confidence_length=8"]
# name -> (config in conf/, overlays): every shipped config and variant, and every pair that composes
# (docs/variants/README.md); conf/embedded_size/ only sizes the embedded model, which TINY replaces
CASES = {
    "grpo": ("base", []), "demo": ("demo", []), "dapo": ("base", ["+variant=dapo"]),
    "cpo": ("base", ["+variant=cpo"]), "mtpo": ("base", ["+variant=mtpo"]),
    "graded_prompt": ("base", ["+variant=graded_prompt"]), "dapo+cpo": ("base", ["+variant=[dapo,cpo]"]),
    "dapo+mtpo": ("base", ["+variant=[dapo,mtpo]"]), "dapo+graded_prompt": ("base", ["+variant=[dapo,graded_prompt]"]),
    "dapo+agents": ("base", ["+variant=dapo", "algorithm.experience_maker=agent_episodes",
                             "agents.environment=tests.e2e.e2e_environments:Retry", "agents.limits.max_total_tokens=160",
                             "+reward.sources.arithmetic=tests.e2e.e2e_rewards.character_parity"]),  # mixed groups: DAPO keeps some
}


def chain(maker):
    """[maker, wrappers innermost first]."""
    parts = [maker]
    while isinstance(parts[-1], ExperienceWrapper):
        parts.append(parts[-1].inner)
    return parts[::-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Components per case, built once for the module."""
    components = {}
    for case, (name, overlays) in CASES.items():
        cfg = load_config(name, overlays + TINY + (MTPO_SIZES if "mtpo" in case else []))  # read by two rounds only
        components[case] = build_components(cfg, tmp_path_factory.mktemp(case.replace("+", "_")))
    yield components
    for parts in components.values():
        parts.rewards.close()


def test_every_registered_maker_and_wrapper_is_built_in_a_case(built):
    makers, wrappers = set(), set()
    for parts in built.values():
        first, *rest = chain(parts.maker)
        makers.add(type(first))
        wrappers.update(type(wrapper) for wrapper in rest)
    registered_makers = {EXPERIENCE_MAKERS.get(name) for name in EXPERIENCE_MAKERS.names()}
    registered_wrappers = {EXPERIENCE_WRAPPERS.get(name) for name in EXPERIENCE_WRAPPERS.names()}
    assert makers == registered_makers, "add a case building the missing maker"
    assert wrappers == registered_wrappers, "add a case building the missing wrapper"


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_of_experience_is_well_formed(built, case):
    parts = built[case]
    batch, metrics = parts.maker.make_experience(parts.train_loader, step=0)
    assert isinstance(batch, ExperienceBatch) and all(isinstance(v, float) for v in metrics.values())
    if case.startswith("dapo"):  # the filter ran on every generated group
        assert metrics["dynamic_sampling/generated_groups"] >= 2
    if len(batch) == 0:  # dynamic sampling kept no group within its bound (the barely warmed-up model
        assert case.startswith("dapo") and case != "dapo+agents"  # answers alike): the loop skips the update
        return
    rows, width = batch.response_ids.shape
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.shape[0] == rows
    assert batch.response_valid.shape == batch.response_mask.shape == (rows, width)
    assert not (batch.response_mask & ~batch.response_valid).any(), "response_mask must be a subset of response_valid"
    assert batch.prompt_mask[:, -1].all(), "prompts are left-padded"
    valid = batch.response_valid.long()
    assert (valid[:, 1:] <= valid[:, :-1]).all(), "responses are right-padded"
    assert len(batch.samples) == rows
    sizes = torch.unique(batch.group_ids, return_counts=True)[1]
    assert (sizes == 4).all(), "whole groups of rollout.n samples"
    for part in chain(parts.maker):
        for name in part.writes:
            value = getattr(batch, name)
            assert value is not None and value.shape[0] == rows, f"{type(part).__name__} declares it writes {name}"
    for name in set(ExperienceBatch.__dataclass_fields__) - BASE_FIELDS:
        value = getattr(batch, name)
        assert value is None or value.shape[0] == rows, name


@pytest.mark.parametrize("case", list(CASES))
def test_the_maker_state_round_trips(built, case):
    maker = built[case].maker
    state = copy.deepcopy(maker.state_dict())
    maker.load_state_dict(state)
    assert repr(maker.state_dict()) == repr(state)
