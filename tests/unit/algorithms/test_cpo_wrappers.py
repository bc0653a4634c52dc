"""Every CPO wrapper against a per-token float64 reference written here from the formula table
(the table in docs/variants/cpo.md), on 4 rows x 4 tokens chosen so every branch fires."""

import math

import pytest
import torch

from aligner_ext.algorithms.cpo import CPOConfig, mutual_information, shaping_inputs, uncertainty
from aligner_ext.algorithms.cpo_wrappers import CPO_WRAPPERS
from aligner_ext.batch import ExperienceBatch

POS, NEG, LAM = 0.3, 0.7, 2.0
VOCAB = 50
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]
CORRECT = [True, True, False, False]
# token probabilities without / with the hint: ratios >= 2 (P), <= 1/2 (N), in between, MI > 10, Δ beyond ±10
P_OLD = [[0.2, 0.5, 0.9, 0.3], [0.3, 0.6, 1e-5, 0.4], [0.25, 0.8, 0.5, 1e-5], [0.1, 0.7, 0.4, 0.2]]
P_HINT = [[0.6, 0.2, 0.95, 0.3], [0.9, 0.2, 0.9, 0.4], [0.75, 0.3, 0.5, 0.9], [0.5, 0.3, 1e-6, 0.2]]
ENTROPY = [[1.0, 2.0, 0.5, 9.0], [0.2, 1.5, 3.0, 2.5], [2.0, 1.0, 0.4, 0.1], [0.3, 0.9, 2.4, 7.0]]  # 9, 7: padding
# GRPO advantages, with one token of a correct row below 0 and one of a wrong row above 0, so sign-clamps bind
ADV = [[0.0, 0.0, 0.0, 0.0], [0.8, 0.02, 0.8, -0.05], [-0.6, -0.01, 0.04, -0.6], [0.0, 0.0, 0.0, 0.0]]
SEVENTEEN = ["naive", "naive_qwen3", "noaccmask_qwen3", "mi_qwen3", "mi_accmask_qwen3", "mi_unify_qwen3",
             "mi_clamp_unify_qwen3", "mi_clamp_unify_difficulty_qwen3", "mi3_qwen3", "negonly_mi3_qwen3",
             "negonly_mi_qwen3", "reverse_mi3_qwen3", "addition_mi3_qwen3", "mi2_qwen3", "negonly_seq_kl_qwen3",
             "seq_kl_qwen3", "negonly_tok_kl_qwen3"]


def make_batch():
    mask = torch.tensor(MASK, dtype=torch.bool)
    return ExperienceBatch(
        prompt_ids=torch.zeros(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.bool),
        response_ids=torch.zeros(4, 4, dtype=torch.long), response_valid=mask, response_mask=mask,
        group_ids=torch.arange(4), samples=[],
        old_logprobs=torch.tensor(P_OLD, dtype=torch.float64).log(),
        hint_logprobs=torch.tensor(P_HINT, dtype=torch.float64).log(),
        has_hint=torch.ones(4, dtype=torch.bool), entropy=torch.tensor(ENTROPY, dtype=torch.float64),
    )


def reference_uncertainty(i, mode):
    row = [ENTROPY[i][t] for t in range(4) if MASK[i][t]]
    if mode == "vocab":
        return [h / math.log(VOCAB) for h in ENTROPY[i]]
    return [(h - min(row)) / (max(row) - min(row) + 1e-8) for h in ENTROPY[i]]


def reference(name, mode, difficulty):
    """The table, token by token, in Python floats (float64)."""
    out = [list(r) for r in ADV]
    for i in range(4):
        c, d = CORRECT[i], difficulty[i]
        hard, easy = d < 0, d > 0
        valid = [t for t in range(4) if MASK[i][t]]
        u = reference_uncertainty(i, mode)
        h_max = max(ENTROPY[i][t] for t in valid)
        kl_mean = sum(math.log(P_HINT[i][t] / P_OLD[i][t]) for t in valid) / (len(valid) + 1e-10)
        h_mean = sum(ENTROPY[i][t] for t in valid) / (len(valid) + 1e-10)
        for t in valid:
            a, h, po, ph = out[i][t], ENTROPY[i][t], P_OLD[i][t], P_HINT[i][t]
            delta = math.log(ph) - math.log(po)
            mi = ph * delta
            ratio = min(max(math.exp(delta), 1 / LAM), LAM)
            p_set = ratio >= LAM and ph > 0.1
            n_set = ratio <= 1 / LAM and po > 0.1
            clamp = False
            if name in ("naive", "naive_qwen3", "noaccmask"):
                if name == "naive_qwen3":
                    p_set, n_set = p_set and c, n_set and not c
                a += POS * h if p_set else 0.0
                a -= NEG * (h_max - h) if n_set else 0.0
                clamp = name != "naive"
            elif name == "mi":
                a += POS * mi * u[t] if mi >= 0 else NEG * mi * (1 - u[t])
                clamp = True
            elif name == "mi_accmask":
                if mi >= 0 and c:
                    a += POS * mi * (1 + u[t])
                if mi < 0 and not c:
                    a += NEG * mi * (2 - u[t])
                clamp = True
            elif name in ("mi_unify", "mi_clamp_unify"):
                m = min(mi, 10.0) if name == "mi_clamp_unify" else mi
                a += (POS if c else NEG) * m * (1 - u[t])
                clamp = True
            elif name == "mi_clamp_unify_difficulty":
                a += (POS if d != 0 else NEG) * min(mi, 10.0) * (1 - u[t])
            elif name in ("mi3", "negonly_mi3", "reverse_mi3", "addition_mi3"):
                if c:
                    a += POS * u[t]
                elif name != "negonly_mi3" or hard:
                    sign = -1.0 if name == "reverse_mi3" else 1.0
                    if mi >= 0:
                        a += sign * NEG * mi * u[t]
                    elif name != "addition_mi3":
                        a += sign * NEG * mi * (1 - u[t])
            elif name in ("negonly_mi", "mi2"):
                if c:
                    a += POS * u[t]
                elif name == "mi2" or hard:
                    a += NEG * mi
            elif name == "negonly_seq_kl":
                if c:
                    a += POS * kl_mean
                elif hard:
                    a += NEG * kl_mean
            elif name == "seq_kl":
                if c:
                    a += POS * h_mean if easy else max(POS * h_mean, -abs(a) / 2)
                else:
                    a += NEG * kl_mean if hard else min(NEG * kl_mean, abs(a) / 2)
            elif name in ("negonly_tok_kl", "tok_kl"):
                dc = min(max(delta, -10.0), 10.0)
                if c:
                    a += POS * u[t]
                elif hard:
                    a += NEG * dc
                elif name == "tok_kl":
                    a += min(NEG * dc, abs(a) / 2)
            elif name != "none":
                raise AssertionError(name)
            if clamp:
                a = max(a, 0.0) if c else min(a, 0.0)
            out[i][t] = a
    return torch.tensor(out, dtype=torch.float64)


BARE = ["none", "naive", "naive_qwen3", "noaccmask", "mi", "mi_accmask", "mi_unify", "mi_clamp_unify",
        "mi_clamp_unify_difficulty", "mi3", "negonly_mi3", "reverse_mi3", "addition_mi3", "negonly_mi", "mi2",
        "negonly_seq_kl", "seq_kl", "negonly_tok_kl", "tok_kl"]


@pytest.mark.parametrize("mode", ["minmax", "vocab"])
@pytest.mark.parametrize("levels", [[1, 0, 0, -1], [2, -1, 1, -2]], ids=["three", "five"])
@pytest.mark.parametrize("name", BARE)
def test_wrapper_matches_the_float64_reference(name, mode, levels):
    cfg = CPOConfig(cpo_lambda=LAM, pos_alpha=POS, neg_alpha=NEG, uncertainty=mode)
    inputs = shaping_inputs(make_batch(), torch.tensor(CORRECT), torch.tensor(levels), cfg, VOCAB)
    got = CPO_WRAPPERS.get(name)(torch.tensor(ADV, dtype=torch.float64), inputs)
    torch.testing.assert_close(got, reference(name, mode, levels), rtol=0, atol=1e-12)


def test_the_data_makes_every_branch_fire():
    """Guards the test data: each wrapper changes something, and the branches with bounds bind."""
    levels = [1, 0, 0, -1]
    base = torch.tensor(ADV, dtype=torch.float64)
    for name in BARE[1:]:
        assert not torch.equal(reference(name, "minmax", levels), base), name
    assert not torch.equal(reference("mi_clamp_unify", "minmax", levels), reference("mi_unify", "minmax", levels))
    assert not torch.equal(reference("tok_kl", "minmax", levels), reference("negonly_tok_kl", "minmax", levels))
    assert not torch.equal(reference("naive", "minmax", levels), reference("noaccmask", "minmax", levels))
    clamped = reference("mi", "minmax", levels)  # MI = 0 there: only the sign-clamp moves these two tokens
    assert clamped[1, 3] == 0.0 and clamped[2, 2] == 0.0


def test_the_seventeen_seed_names_and_aliases_resolve():
    for name in SEVENTEEN + ["tok_kl_qwen3", "naive_accmask"]:
        assert callable(CPO_WRAPPERS.get(name)), name
    for name in SEVENTEEN:
        if name.endswith("_qwen3") and name != "naive_qwen3":
            assert CPO_WRAPPERS.get(name) is CPO_WRAPPERS.get(name[: -len("_qwen3")]), name
    assert CPO_WRAPPERS.get("naive_qwen3") is not CPO_WRAPPERS.get("naive")
    with pytest.raises(KeyError, match="unknown cpo advantage wrapper 'mi4'"):
        CPO_WRAPPERS.get("mi4")


def test_mutual_information_by_hand():
    hint = torch.tensor([0.5, 0.2], dtype=torch.float64).log()
    plain = torch.tensor([0.25, 0.4], dtype=torch.float64).log()
    # 0.5 * ln(0.5 / 0.25) = 0.5 ln 2;  0.2 * ln(0.2 / 0.4) = -0.2 ln 2
    expected = torch.tensor([0.5 * math.log(2), -0.2 * math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(mutual_information(hint, plain), expected, rtol=0, atol=1e-15)


def test_uncertainty_by_hand():
    entropy = torch.tensor([[1.0, 3.0, 2.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    # min-max over the three response tokens: min 1, max 3; padding gets 0
    torch.testing.assert_close(uncertainty(entropy, mask, "minmax", 7),
                               torch.tensor([[0.0, 2 / (2 + 1e-8), 1 / (2 + 1e-8), 0.0]], dtype=torch.float64))
    # H / log V with V = e^2: halves every entropy
    torch.testing.assert_close(uncertainty(entropy, mask, "vocab", math.e ** 2),
                               torch.tensor([[0.5, 1.5, 1.0, 0.0]], dtype=torch.float64))
