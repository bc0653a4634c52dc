"""The embedded model's warm-up under CPO: with `cpo.hint.warmup_share`, a share of the rows is also shown on
its hinted prompt (the hint placed as the hint pass places it) with its gold solution as target."""

from aligner_ext.config import load_config
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.trainer.build import warmup_examples

ROWS = builtin_rows("chain_sums", "train", 400, seed=0)


def plain(rows):
    return [(row.messages, row.extra_info["gold_solution"]) for row in rows]


def test_every_row_hinted_at_share_one():
    first = ROWS[1]  # "85+21+8=", gold "85+21=106\n106+8=114\n\boxed{114}"
    examples = warmup_examples(load_config("demo", ["+variant=cpo", "cpo.hint.warmup_share=1"]), [first])
    gold = "85+21=106\n106+8=114\n\\boxed{114}"
    assert examples == [([{"role": "user", "content": "85+21+8="}], gold),
                        ([{"role": "user", "content": f"{gold}\n85+21+8="}], gold)]  # user_prefix: "{hint}\n" first


def test_share_of_rows_hinted_and_the_same_for_every_trainer_seed():
    examples = warmup_examples(load_config("demo", ["+variant=cpo", "cpo.hint.warmup_share=0.25"]), ROWS)
    assert examples[:len(ROWS)] == plain(ROWS)
    hinted = examples[len(ROWS):]
    assert 70 <= len(hinted) <= 130  # binomial(400, 0.25): mean 100, sd 8.7
    golds = {row.messages[0]["content"]: row.extra_info["gold_solution"] for row in ROWS}
    for messages, target in hinted:  # each: some row's gold, a newline, that row's question; its gold as target
        question = messages[0]["content"].rsplit("\n", 1)[1]
        assert messages == [{"role": "user", "content": f"{golds[question]}\n{question}"}] and target == golds[question]
    other_seed = load_config("demo", ["+variant=cpo", "cpo.hint.warmup_share=0.25", "trainer.seed=3"])
    assert warmup_examples(other_seed, ROWS) == examples  # one warm-up serves every seed


def test_no_hinted_examples_by_default_or_when_nothing_reads_the_hint_pass():
    assert warmup_examples(load_config("demo", ["+variant=cpo"]), ROWS) == plain(ROWS)
    grpo = load_config("demo", ["cpo.hint.warmup_share=1"])  # GRPO's estimator does not read hint_logprobs
    assert warmup_examples(grpo, ROWS) == plain(ROWS)
