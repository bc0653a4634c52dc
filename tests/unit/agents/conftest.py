"""Tokenizers that render real chat templates (tests/fixtures/chat_templates/) without a download (one
token per printable ASCII character plus the family's special tokens, so every id is known by hand),
and typed arithmetic functions to serve as tools."""

import string
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
CHARS = sorted(set(string.printable) - set("\r\x0b\x0c"))
QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MISTRAL_SPECIAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
GEMMA_SPECIAL = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"]


def chat_tokenizer(template: str, special: list[str], added: list[str], eos: str, bos: str | None = None):
    """A character tokenizer: ids 0 .. len(CHARS) - 1 are the characters, then the special tokens, then
    the added (non-special) ones, as in the models' own vocabularies."""
    core = Tokenizer(models.WordLevel(vocab={char: index for index, char in enumerate(CHARS)}, unk_token="~"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    tokenizer.eos_token, tokenizer.bos_token = eos, bos
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    return chat_tokenizer("qwen2_5.jinja", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>")


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return chat_tokenizer("qwen3.jinja", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>")


@pytest.fixture(scope="session")
def llama31_tokenizer():
    return chat_tokenizer("llama3_1.jinja", LLAMA_SPECIAL, [], eos="<|eot_id|>", bos="<|begin_of_text|>")


@pytest.fixture(scope="session")
def qwen35_tokenizer():
    return chat_tokenizer("qwen3_5.jinja", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>")


@pytest.fixture(scope="session")
def mistral_tokenizer():
    return chat_tokenizer("mistral.jinja", MISTRAL_SPECIAL, [], eos="</s>", bos="<s>")


@pytest.fixture(scope="session")
def mistral_tekken_tokenizer():
    return chat_tokenizer("mistral_tekken.jinja", MISTRAL_SPECIAL, [], eos="</s>", bos="<s>")


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


@pytest.fixture(scope="session")
def arithmetic():
    """Tools by name: add (b defaults to 2), mul, divide."""
    return {"add": add, "mul": mul, "divide": divide}
