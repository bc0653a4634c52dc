"""StopStringMatcher on crafted token streams: multi-token and in-token stop strings, tokens that
decode to nothing, window-start artefacts, and the size of the decoded window."""

import numpy as np
import pytest

from aligner_ext.generation.stopping import MARGIN_TOKENS, StopStringMatcher

# A made-up vocabulary with multi-character pieces and one piece that decodes to nothing.
PIECES = {0: "ab", 1: "</", 2: "ans", 3: "wer", 4: ">", 5: ">x", 6: "", 7: "z", 8: "</answer>"}


def join_pieces(ids):
    return "".join(PIECES[i] for i in ids)


def first_stop(matcher, stream):
    """Feed `stream` one token at a time; index of the token that completed a stop string, or None."""
    for end in range(1, len(stream) + 1):
        if matcher.completed_by_last_token(stream[:end]):
            return end - 1
    return None


def test_stop_string_spanning_several_tokens_fires_on_the_completing_token():
    matcher = StopStringMatcher(["</answer>"], join_pieces)
    # "ab" "</" "ans" "wer" ">" "z" "z": the stop string ends in token 4; tokens after it are not reached.
    assert first_stop(matcher, [0, 1, 2, 3, 4, 7, 7]) == 4


def test_completing_token_may_carry_text_past_the_stop_string():
    matcher = StopStringMatcher(["</answer>"], join_pieces)
    assert first_stop(matcher, [0, 1, 2, 3, 5, 7]) == 4  # ">x" completes it


def test_stop_string_inside_one_token():
    matcher = StopStringMatcher(["</answer>"], join_pieces)
    assert first_stop(matcher, [0, 8, 7]) == 1


def test_empty_tokens_between_the_pieces_grow_the_window():
    # 40 empty pieces separate "</ans" from "wer>": a fixed window of len("</answer>") + MARGIN_TOKENS
    # tokens would hold only "wer>".
    matcher = StopStringMatcher(["</answer>"], join_pieces)
    stream = [1, 2] + [6] * 40 + [3, 4]
    assert first_stop(matcher, stream) == 43


def test_first_completed_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["</answer>", "ns"], join_pieces)
    assert first_stop(matcher, [0, 1, 2, 3, 4]) == 2  # "ans" completes "ns" before "</answer>"


def test_margin_absorbs_an_artefact_at_the_window_start():
    # One character per token; the decoder drops the first character of whatever it decodes (as a
    # SentencePiece decoder drops a leading space). "zz</answer>" ends at token 10; without the margin
    # the window would be exactly the 9 stop tokens and decode to "/answer>".
    chars = dict(enumerate("z</answer>"))
    ids = [0, 0] + list(range(1, 10))

    def drop_first_char(window):
        return "".join(chars[i] for i in window)[1:]

    assert MARGIN_TOKENS >= 1
    assert first_stop(StopStringMatcher(["</answer>"], drop_first_char), ids) == 10


def test_decoded_window_stays_short_on_a_long_stream():
    seen_lengths = []

    def counting_decode(window):
        seen_lengths.append(len(window))
        return join_pieces(window)

    matcher = StopStringMatcher(["</answer>"], counting_decode)
    assert first_stop(matcher, [7] * 500) is None
    assert max(seen_lengths) == len("</answer>") + MARGIN_TOKENS


def test_real_character_tokenizer(tiny_tokenizer):
    def decode(ids):
        return tiny_tokenizer.decode(ids, skip_special_tokens=True)

    matcher = StopStringMatcher(["</answer>"], decode)
    stream = tiny_tokenizer.encode("abc</answer>xyz")
    assert first_stop(matcher, stream) == len("abc</answer>") - 1


def test_no_stop_strings_never_fires():
    assert first_stop(StopStringMatcher([], join_pieces), [1, 2, 3, 4]) is None


@pytest.mark.parametrize("bad", ["", None])
def test_empty_stop_string_is_rejected(bad):
    with pytest.raises(ValueError, match="stop string 1"):
        StopStringMatcher(["ok", bad], join_pieces)


def test_prefilter_passes_only_tokens_that_can_end_a_stop_string():
    texts = {0: "ab", 1: ">", 2: "", 3: "\ufffd", 4: "x>y", 5: "/a"}
    calls = []

    def decode(ids):
        calls.append(list(ids))
        return "".join(texts[i] for i in ids)

    matcher = StopStringMatcher(["</a>"], decode)
    tokens = np.array([0, 1, 2, 3, 4, 5, 0, 5])
    # ">" ends the stop string: tokens holding it pass; an empty text (a special token, a dropped
    # space) and a replacement character (an incomplete byte sequence) pass because their text in
    # context is unknown; "ab" and "/a" cannot end it
    assert matcher.may_complete(tokens).tolist() == [False, True, True, True, True, False, False, False]
    assert sorted(map(tuple, calls)) == [(0,), (1,), (2,), (3,), (4,), (5,)]  # each id decoded once
    matcher.may_complete(np.array([4, 0]))
    assert len(calls) == 6
    # a stop string ending in whitespace could end in a token decoded without its leading space
    assert StopStringMatcher(["a\n", "</a>"], decode).may_complete(tokens).all()
