"""Incremental stop-string detection over generated token ids.

The engine asks, after every sampled token, whether that token completed one of the stop strings.
Because the question is asked at every step, a stop string that is found now must end inside the
text of the newest token: an earlier end would have been caught earlier. So only a tail window
of tokens needs decoding, never the whole response (and never the prompt: the matcher only ever
sees generated ids, so a stop string in the prompt, or one that starts in the prompt and ends in
the response, does not count).

Window bound. A stop string of at most L characters ending in the newest token's text starts at
most L - 1 characters before that text, so the window must hold at least L - 1 characters ahead
of the newest token. A fixed count of tokens is not a safe bound, because some tokens decode to
nothing (special tokens under `skip_special_tokens`, pieces of a multi-byte character). The
window therefore starts at `L + MARGIN_TOKENS` tokens (enough when every token decodes to at least
one character, the usual case: two short decodes per step) and doubles until the tokens between
the margin and the newest token decode to at least L - 1 characters, or it reaches the first
generated token.

MARGIN_TOKENS extra tokens at the window's start absorb decoding artefacts at a cut: a
SentencePiece decoder drops the leading space of the first piece, and a byte-level BPE window
that starts inside a multi-byte UTF-8 character (at most 3 continuation bytes) renders those
bytes as replacement characters. Beyond that margin we assume decoding is local (decoding a
suffix of the ids gives a suffix of the text), which holds for byte-level BPE, SentencePiece and
character tokenizers.

Prefilter. Batched engines ask first, for a whole step's tokens at once, which of them could be the
last token of a stop string (`may_complete`): one whose own text (decoded alone) contains the last
character of some stop string. Decoded alone, a token may lose a leading space (SentencePiece) or
show replacement characters for bytes of a character it does not complete (byte-level BPE), so a
token whose text is empty or holds a replacement character always passes, and so does every token
when a stop string ends in whitespace. The texts are decoded once per token id per matcher.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

MARGIN_TOKENS = 4  # tokens at a window's start whose text may differ from the full decode


class StopStringMatcher:
    """Tells whether the newest generated token completed a stop string.

    Args:
        stop: the stop strings; empty strings are rejected (they would match everywhere).
        decode: token ids -> text, as the response text will be read (e.g. a tokenizer's decode
            with `skip_special_tokens=True`).
    """

    def __init__(self, stop: Sequence[str], decode: Callable[[list[int]], str]):
        for index, text in enumerate(stop):
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop string {index} is {text!r}; stop strings must be non-empty str")
        self.stop = list(stop)
        self.decode = decode
        self.max_chars = max((len(text) for text in self.stop), default=0)  # L, in characters
        self.last_chars = {text[-1] for text in self.stop}
        self.filters = not any(char.isspace() for char in self.last_chars)
        self.can_end = np.zeros(0, dtype=np.int8)  # per token id: 1 may end a stop string, 0 cannot, -1 not decoded yet

    def __bool__(self) -> bool:
        return bool(self.stop)

    def may_complete(self, token_ids: np.ndarray) -> np.ndarray:
        """Per token of `token_ids`, False where it cannot be the last token of a stop string (module
        docstring, "Prefilter"); True otherwise."""
        if not self.filters or not len(token_ids):
            return np.ones(len(token_ids), dtype=bool)
        if token_ids.max() >= len(self.can_end):
            grown = np.full(int(token_ids.max()) + 1, -1, dtype=np.int8)
            grown[: len(self.can_end)] = self.can_end
            self.can_end = grown
        for token in np.unique(token_ids[self.can_end[token_ids] < 0]):
            text = self.decode([int(token)])
            self.can_end[token] = not text or "\ufffd" in text or any(char in text for char in self.last_chars)
        return self.can_end[token_ids] == 1

    def completed_by_last_token(self, generated: Sequence[int]) -> bool:
        """True if a stop string occurs in the decoded `generated` ids, ending in the last token.

        Assumes the earlier prefixes were already checked (no stop string ended before the last
        token). `generated` holds response ids only, never prompt ids.
        """
        if not self.stop or not generated:
            return False
        ids = list(generated)
        n = len(ids)
        span = self.max_chars + MARGIN_TOKENS  # window length, in tokens
        while True:
            start = max(0, n - span)
            if start == 0 or len(self.decode(ids[start + MARGIN_TOKENS : n - 1])) >= self.max_chars - 1:
                break
            span *= 2
        text = self.decode(ids[start:n])
        return any(stop in text for stop in self.stop)
