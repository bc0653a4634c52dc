"""PromptLoader: overlong policies, epoch crossing, shuffling, resume, validation pass; DataConfig."""

import json
import logging

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.loader import DataConfig, PromptLoader, build_loader, load_split
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError
from aligner_ext.models.tiny import build_char_tokenizer

# ChatML around one user message costs 19 tokens with the character tokenizer:
# <|im_start|> + "user\n" (5) + content + <|im_end|> + "\n" + <|im_start|> + "assistant\n" (10)
OVERHEAD = 1 + 5 + 1 + 1 + 1 + 10


def make_rows(contents):
    return [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": c}], data_source="t",
                      ground_truth="x") for i, c in enumerate(contents)]


def chatml_tokens(content):
    return ["<|im_start|>", *"user\n", *content, "<|im_end|>", "\n", "<|im_start|>", *"assistant\n"]


def loader_over(tokenizer, n, batch_size, shuffle=False, seed=0, **cfg):
    rows = make_rows([f"r{i}" for i in range(n)])
    return PromptLoader(rows, tokenizer, DataConfig(seed=seed, **cfg), batch_size, shuffle)


def row_indices(batch):
    return [int(draw.row.row_id.split(":")[1]) for draw in batch]


# contents of 1, 10 and 30 characters: prompts of 20, 29 and 49 tokens; the limit 35 cuts only the last
OVERLONG_ROWS = ["a", "b" * 10, "c" * 30]


def test_overlong_error_names_the_row_and_lengths(tiny_tokenizer):
    cfg = DataConfig(max_prompt_length=35, overlong_prompt="error")
    expected = (r"1 of 3 prompts \(field 'prompt', chat template included\) are longer than "
                r"data.max_prompt_length=35.*row t:2 \(49 tokens\)")
    with pytest.raises(DataError, match=expected):
        PromptLoader(make_rows(OVERLONG_ROWS), tiny_tokenizer, cfg, batch_size=2, shuffle=False)


def test_overlong_skip_drops_counts_and_logs_once(tiny_tokenizer, caplog):
    cfg = DataConfig(max_prompt_length=35, overlong_prompt="skip")
    with caplog.at_level(logging.WARNING, logger="aligner_ext.data.loader"):
        loader = PromptLoader(make_rows(OVERLONG_ROWS), tiny_tokenizer, cfg, batch_size=4, shuffle=False)
        draws = loader.next_batch() + loader.next_batch()
    assert len(loader) == 2
    assert loader.num_skipped_overlong == 1
    assert loader.metrics()["data/num_skipped_overlong"] == 1
    assert {draw.row.row_id for draw in draws} == {"t:0", "t:1"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 3" in warnings[0].getMessage()
    assert [len(draw.prompt_ids) for draw in draws[:2]] == [1 + OVERHEAD, 10 + OVERHEAD]


def test_overlong_truncate_left_keeps_the_last_tokens(tiny_tokenizer):
    cfg = DataConfig(max_prompt_length=35, overlong_prompt="truncate_left")
    loader = PromptLoader(make_rows(OVERLONG_ROWS), tiny_tokenizer, cfg, batch_size=3, shuffle=False)
    draws = loader.next_batch()
    assert loader.num_truncated_overlong == 1
    assert loader.metrics()["data/num_truncated_overlong"] == 1
    expected = tiny_tokenizer.convert_tokens_to_ids(chatml_tokens("c" * 30)[-35:])
    assert draws[2].prompt_ids == expected
    # the kept tail: after the content come 1 + 1 + 1 + 10 = 13 tokens, so 35 - 13 = 22 of the 30 "c"s
    assert tiny_tokenizer.decode(draws[2].prompt_ids) == "c" * 22 + "<|im_end|>\n<|im_start|>assistant\n"
    assert draws[0].prompt_ids == tiny_tokenizer.convert_tokens_to_ids(chatml_tokens("a"))


def test_a_row_the_chat_template_refuses_is_a_data_error_naming_it():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
                               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    rows = make_rows(["a", "b"])
    rows[1].messages.insert(0, {"role": "system", "content": "s"})
    with pytest.raises(DataError, match=r"^row t:1: field 'prompt': the tokenizer's chat template refuses these "
                                        r"messages \(TemplateError: roles must alternate user/assistant\)"):
        PromptLoader(rows, tokenizer, DataConfig(), batch_size=1, shuffle=False)


def test_all_rows_skipped_is_an_error(tiny_tokenizer):
    cfg = DataConfig(max_prompt_length=20, overlong_prompt="skip")
    with pytest.raises(DataError, match="no prompts left"):
        PromptLoader(make_rows(["bb", "ccc"]), tiny_tokenizer, cfg, batch_size=1, shuffle=False)


def test_empty_dataset_is_an_error(tiny_tokenizer):
    with pytest.raises(ValueError, match="empty dataset"):
        PromptLoader([], tiny_tokenizer, DataConfig(), batch_size=1, shuffle=False)


def test_batches_cross_epoch_boundaries_in_order(tiny_tokenizer):
    loader = loader_over(tiny_tokenizer, n=5, batch_size=3)
    batches = [loader.next_batch() for _ in range(3)]
    assert [row_indices(b) for b in batches] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    assert [[d.draw_id for d in b] for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # 9 draws over 5 rows: epoch 1, position 4
    assert (loader.epoch, loader.position) == (1, 4)
    assert loader.metrics()["data/epoch"] == 1


def test_shuffled_epochs_are_permutations_deterministic_per_seed(tiny_tokenizer):
    loader = loader_over(tiny_tokenizer, n=20, batch_size=10, shuffle=True, seed=3)
    epochs = [row_indices(loader.next_batch() + loader.next_batch()) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(20))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != list(range(20))
    again = loader_over(tiny_tokenizer, n=20, batch_size=10, shuffle=True, seed=3)
    assert [row_indices(again.next_batch() + again.next_batch()) for _ in range(3)] == epochs
    other = loader_over(tiny_tokenizer, n=20, batch_size=10, shuffle=True, seed=4)
    assert row_indices(other.next_batch() + other.next_batch()) != epochs[0]


def test_draw_ids_are_unique_and_count_the_stream(tiny_tokenizer):
    loader = loader_over(tiny_tokenizer, n=4, batch_size=3, shuffle=True)
    ids = [draw.draw_id for _ in range(7) for draw in loader.next_batch()]
    assert ids == list(range(21))


def test_state_round_trip_resumes_the_same_batches(tiny_tokenizer):
    first = loader_over(tiny_tokenizer, n=7, batch_size=3, shuffle=True, seed=1)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as plain data
    expected = [first.next_batch() for _ in range(2)]
    resumed = loader_over(tiny_tokenizer, n=7, batch_size=3, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    got = [resumed.next_batch() for _ in range(2)]
    assert [[(d.row.row_id, d.draw_id, d.prompt_ids) for d in b] for b in got] == \
           [[(d.row.row_id, d.draw_id, d.prompt_ids) for d in b] for b in expected]
    assert got[0][0].draw_id == 9  # 3 batches of 3 drawn before the save


def test_resume_with_other_data_or_seed_is_an_error(tiny_tokenizer):
    state = loader_over(tiny_tokenizer, n=7, batch_size=3, shuffle=True, seed=1).state_dict()
    with pytest.raises(DataError, match="num_rows=7"):
        loader_over(tiny_tokenizer, n=6, batch_size=3, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed=1"):
        loader_over(tiny_tokenizer, n=7, batch_size=3, shuffle=True, seed=2).load_state_dict(state)


def test_iterate_once_is_one_ordered_pass_and_leaves_the_stream(tiny_tokenizer):
    loader = loader_over(tiny_tokenizer, n=5, batch_size=2, shuffle=True)
    loader.next_batch()
    batches = list(loader.iterate_once())
    assert [row_indices(b) for b in batches] == [[0, 1], [2, 3], [4]]
    assert [d.draw_id for b in batches for d in b] == [0, 1, 2, 3, 4]
    assert (loader.epoch, loader.position) == (0, 2)


def test_data_config_rejects_bad_values():
    with pytest.raises(ValueError, match="^data.overlong_prompt='drop': must be one of error, skip, truncate_left$"):
        load_config("base", ["data.overlong_prompt=drop"])
    with pytest.raises(ValueError, match="^data.train_batch_size=0: must be a finite number >= 1$"):
        load_config("base", ["data.train_batch_size=0"])
    with pytest.raises(ValueError, match="^data.seed=-1: must be a finite number >= 0$"):
        load_config("base", ["data.seed=-1"])


def test_load_split_prefers_files_and_skips_builtin_val_for_user_data(tmp_path):
    path = tmp_path / "train.jsonl"
    record = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "t", "reward_model": {"ground_truth": "x"}}
    path.write_text(json.dumps(record) + "\n")
    user = DataConfig(train_files=[str(path)])
    assert [row.row_id for row in load_split(user, "train")] == [f"{path}:0"]
    assert load_split(user, "val") == []
    builtin = DataConfig(builtin_train_size=6, builtin_val_size=4)
    train, val = load_split(builtin, "train"), load_split(builtin, "val")
    assert [row.row_id for row in train] == [f"builtin/arithmetic/train:{i}" for i in range(6)]
    assert [row.row_id for row in val] == [f"builtin/arithmetic/val:{i}" for i in range(4)]
    assert load_split(DataConfig(builtin_val_size=0), "val") == []


def test_build_loader_uses_the_split_batch_size(tiny_tokenizer):
    cfg = DataConfig(builtin_train_size=10, builtin_val_size=5, train_batch_size=4, val_batch_size=3)
    train = build_loader(cfg, tiny_tokenizer, "train")
    assert len(train.next_batch()) == 4 and train.shuffle
    val = build_loader(cfg, tiny_tokenizer, "val")
    assert [len(b) for b in val.iterate_once()] == [3, 2]
    assert build_loader(DataConfig(builtin_val_size=0), tiny_tokenizer, "val") is None
