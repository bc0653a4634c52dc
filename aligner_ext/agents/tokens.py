"""Token-exact trajectories: sampled ids kept as sampled, every other token the chat template's own.

A multi-turn episode is trained on the ids the engine saw and sampled, so a trajectory is built from
ids, never from a re-encoding of its text (decoding sampled ids and encoding them again can give
other ids: the trainer would score tokens that were never sampled). Each id carries a role:

- `prompt`: the first messages as the chat template renders them, with the generation prompt;
- `sampled`: a model turn, appended exactly as the engine returned it (the only ids with a loss);
- `template`: what the template writes after a turn that the model did not sample, e.g. the `\\n`
  Qwen's template puts after `<|im_end|>` (or the whole `<|im_end|>\\n` when generation stopped at a
  stop string);
- `observation`: the new messages (tool results, user feedback) and the next generation prompt.

`add_messages` renders the conversation twice, up to the end of the last model turn and with the new
messages and the generation prompt, and encodes the difference once: the new messages' tokens are
exactly the suffix the template adds, so two tool messages in a row share one block as the
whole-conversation rendering has it, never one block each. The rendering up to the end of the last
turn, minus the trajectory's text, is the `template` boundary.

Some templates render the earlier conversation differently once messages are added (Qwen3 drops the
`<think>` content of turns before the latest user message), and a model turn may not re-render to
its sampled text (a tool call's JSON spaced otherwise than the template writes it). Then the ids
cannot be continued into what the conversation now renders to: `add_messages` leaves the trajectory
as it is and reports `rewrites_history`, and the caller ends this training row and starts the next
one from the whole conversation (`start(trajectory.messages + new_messages)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.agents.tool_calls import ToolCallFormat, tool_call_format

ROLES = ("prompt", "sampled", "template", "observation")


@dataclass
class Trajectory:
    """One training row of an episode: its ids, the role of each, the text they spell, and the
    conversation they encode (model turns as parsed assistant messages)."""

    messages: list[dict[str, Any]]
    ids: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)  # one of ROLES per id
    text: str = ""  # the prompt's rendering + each sampled turn as decoded + the template's suffixes
    logprobs: list[float] = field(default_factory=list)  # per id: the engine's log-prob of a sampled id, 0 elsewhere
    # A mixture of experts' routing as the engine recorded it for the ids up to the end of the latest model
    # turn ([ids, layers, k], `GenerationOutput.routing`); None when the engine recorded none.
    routing: Any = None

    def append(self, ids: list[int], role: str, text: str, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.roles += [role] * len(ids)
        self.text += text
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def prompt_length(self) -> int:
        """Ids of the row's prompt: everything before the first sampled id."""
        return self.roles.index("sampled") if "sampled" in self.roles else len(self.roles)

    def sampled_mask(self) -> list[bool]:
        """True on the ids that carry a loss: the sampled ones."""
        return [role == "sampled" for role in self.roles]


@dataclass
class Extension:
    """What `add_messages` appended, or why it could not."""

    template_ids: list[int] = field(default_factory=list)
    observation_ids: list[int] = field(default_factory=list)
    rewrites_history: bool = False  # the conversation no longer renders to the trajectory: start a new row
    reason: str = ""  # where the renderings part, for the log


class ChatRenderer:
    """Renders one episode's conversation with the tokenizer's chat template and the episode's tools,
    passed as the template's tool-call format names (`tools`; SmolLM3's `xml_tools`; tool_calls.py)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                 call_format: ToolCallFormat | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.tool_arguments = (call_format or tool_call_format(tokenizer)).template_tools(tools) if tools else {}
        self.template_kwargs = template_kwargs  # e.g. enable_thinking for Qwen3

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **self.tool_arguments, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Text the template wrote, encoded once; the template wrote its special tokens itself."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: list[dict[str, Any]]) -> Trajectory:
        """A new row: the conversation so far as a prompt, ending with the generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        trajectory = Trajectory(list(messages))
        trajectory.append(self.encode(text), "prompt", text)
        return trajectory

    def add_turn(self, trajectory: Trajectory, sampled_ids: list[int], message: dict[str, Any],
                 logprobs: list[float] | None = None, routing: Any = None) -> None:
        """Append a model turn: its ids as sampled (with the engine's log-probs of them), and `message`,
        the assistant message parsed from them; `routing`, the experts the engine recorded for the
        trajectory's ids and the turn's, replaces the trajectory's."""
        if not sampled_ids:
            raise ValueError("a model turn has at least one sampled id")
        if logprobs is not None and len(logprobs) != len(sampled_ids):
            raise ValueError(f"a model turn of {len(sampled_ids)} ids came with {len(logprobs)} log-probs")
        if routing is not None and len(routing) != len(trajectory.ids) + len(sampled_ids):
            raise ValueError(f"a model turn's routing covers {len(routing)} tokens, the trajectory and the turn "
                             f"hold {len(trajectory.ids) + len(sampled_ids)}")
        trajectory.routing = routing
        text = self.tokenizer.decode(sampled_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        trajectory.append(list(sampled_ids), "sampled", text, logprobs)
        trajectory.messages.append(message)

    def add_messages(self, trajectory: Trajectory, new_messages: list[dict[str, Any]]) -> Extension:
        """Append the template's boundary after the last model turn and the new messages' tokens, each
        encoded once; or, when the template renders the conversation differently now, append nothing
        and report it (module docstring)."""
        if not trajectory.messages or trajectory.messages[-1].get("role") != "assistant":
            raise ValueError("add_messages follows a model turn (add_turn)")
        closed = self.render(trajectory.messages, add_generation_prompt=False)
        extended = self.render(trajectory.messages + list(new_messages), add_generation_prompt=True)
        if not closed.startswith(trajectory.text):
            return Extension(rewrites_history=True, reason="the conversation re-renders differently from the "
                             "trajectory's text: " + _first_difference(trajectory.text, closed))
        if not extended.startswith(closed):
            return Extension(rewrites_history=True, reason="the new messages change how the template renders the "
                             "conversation before them: " + _first_difference(closed, extended))
        boundary, suffix = closed[len(trajectory.text):], extended[len(closed):]
        extension = Extension(self.encode(boundary) if boundary else [], self.encode(suffix))
        trajectory.append(extension.template_ids, "template", boundary)
        trajectory.append(extension.observation_ids, "observation", suffix)
        trajectory.messages += new_messages
        return extension


def _first_difference(expected: str, rendered: str, context: int = 30) -> str:
    """Where two renderings part: the character, and each around it."""
    at = len(os.path.commonprefix([expected, rendered]))
    start = max(0, at - context)
    return f"at character {at}, {expected[start:at + context]!r} against {rendered[start:at + context]!r}"
