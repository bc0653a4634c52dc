"""The HF engine passes and reads the KV cache under the name the installed transformers asks for,
so a generation prints no deprecation warning about `past_key_values`."""

import inspect
import logging
import warnings

import transformers

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine


class Collected(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def generate_recording(engine, prompts) -> tuple[list[str], list]:
    """Messages about `past_key_values` from Python warnings and from transformers' own logger, and the
    outputs. transformers logs some deprecations once per process: that memory is cleared first, so a
    warning an earlier test printed cannot hide one here."""
    clear = getattr(logging.Logger.warning_once, "cache_clear", None)
    if clear is not None:
        clear()
    handler = Collected()
    library_logger = transformers.utils.logging.get_logger("transformers")
    library_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    finally:
        library_logger.removeHandler(handler)
    messages = [str(w.message) for w in caught] + handler.messages
    return [m for m in messages if "past_key_values" in m], outputs


def test_generation_shows_no_past_key_values_deprecation(tiny_model, tiny_tokenizer):
    engine = HFGenerationEngine(tiny_model, tiny_tokenizer, HFEngineConfig())
    prompts = [tiny_tokenizer.encode("1+2="), tiny_tokenizer.encode("13+4=")]
    about_old_name, outputs = generate_recording(engine, prompts)
    assert about_old_name == []
    assert [len(o.token_ids) for o in outputs] == [5, 5]  # the cached loop ran all its steps
    if "cache" in inspect.signature(tiny_model.forward).parameters:
        # this transformers renamed the argument: the old name is what the recording above would catch
        engine._cache_argument = "past_key_values"
        about_old_name, _ = generate_recording(engine, prompts)
        assert about_old_name
