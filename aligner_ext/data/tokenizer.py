"""The checkpoint's tokenizer, encoding text as the checkpoint's own `tokenizer.json` does.

transformers' AutoTokenizer prefers the class registered for the config's model type over the class the
directory declares (qwen2 -> Qwen2Tokenizer, over the `TokenizersBackend` every tokenizer built with
the `tokenizers` library is saved as). That class rebuilds the tokenizer from the vocabulary with its
own normaliser and pre-tokeniser, so a custom tokenizer saved beside a Qwen2-shaped config (a
random-weight checkpoint at a real shape, as our benchmarks and tests build) encodes other ids
than it was saved with: the character tokenizer loses every space, a word-level one turns a
256-token prompt into 3 tokens. Nothing fails; the run trains on the wrong text.

So the loaded tokenizer is checked against `tokenizer.json` on a probe text, and where the two encode
differently the file's own tokenizer is loaded instead, with one warning naming both classes. A
released checkpoint's tokenizer class reproduces its file, so it is kept as transformers chose it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# ASCII words, digits and operators, runs of spaces, newlines, accents and CJK: where tokenizer classes differ
PROBE = "Solve: 12 + 7 = 19.\n\n  The answer is t100 t200, café naïve 你好!\tdone"


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of `model_dir` (a pad token set to EOS where it has none), as its `tokenizer.json`
    encodes where AutoTokenizer's class would encode otherwise."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    saved = Path(model_dir) / "tokenizer.json"
    if saved.is_file() and not encodes_like_file(tokenizer, Tokenizer.from_file(str(saved))):
        chosen = type(tokenizer).__name__
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        logger.warning("tokenizer: transformers chose %s for %s, which encodes text differently from its "
                       "tokenizer.json; loaded the file's own tokenizer (%s) instead", chosen, model_dir,
                       type(tokenizer).__name__)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encodes_like_file(tokenizer: PreTrainedTokenizerBase, saved: Tokenizer) -> bool:
    """Whether `tokenizer` gives the probe text the ids its saved `tokenizer.json` gives it."""
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    return list(ids) == saved.encode(PROBE, add_special_tokens=False).ids
