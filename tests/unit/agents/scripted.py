"""A scripted policy and scripted environments for the episode-loop tests: the policy's replies are a
function of its prompt's text and the turn's seed, so every expected trajectory is written by hand."""

from aligner_ext.agents.environment import Environment, Episode, StepResult, register_environment
from aligner_ext.agents.episodes import EpisodeRunner
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.agents.tool_calls import ParsedTurn, ToolCall
from aligner_ext.agents.tools import ToolRunner, tool_schema
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.rewards.base import RewardResult

from tests.unit.agents.conftest import add

CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class ScriptedPolicy(GenerationEngine):
    """Replies `reply(prompt text, seed)` followed by the end of turn (`eos`, Qwen's <|im_end|> unless
    given), cut at max_new_tokens; log-prob of the i-th token -(i + 1) / 100. Records every call's
    prompt ids and settings."""

    def __init__(self, tokenizer, reply, eos="<|im_end|>"):
        self.tokenizer, self.reply = tokenizer, reply
        self.eos = tokenizer.convert_tokens_to_ids(eos)
        self.calls = []

    def generate(self, prompts, params):
        outputs = []
        for ids in prompts:
            self.calls.append((list(ids), params.max_new_tokens, params.seed))
            text = self.reply(self.tokenizer.decode(ids, skip_special_tokens=False), params.seed)
            tokens = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos])[: params.max_new_tokens]
            finish = "eos" if tokens[-1] == self.eos else "length"
            outputs.append(GenerationOutput(tokens, finish, [-(i + 1) / 100 for i in range(len(tokens))]))
        return outputs


@register_environment("test_adder")
class Adder(Environment):
    """Asks for a sum; answers `add` calls; done at the first turn without a call; scores the answer."""

    runner = ToolRunner([add])

    async def reset(self, row):
        a, b = row.ground_truth
        return Episode([{"role": "user", "content": f"{a}+{b}?"}], [tool_schema(add)], {"answer": a + b, "log": []})

    async def step(self, message, state):
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        if not calls:
            state["final"] = message["content"]
            return StepResult(done=True)
        return StepResult(await self.runner.answer(ParsedTurn("", calls)), reward=0.25)

    async def score(self, state):
        right = float(state.get("final") == str(state["answer"]))
        return RewardResult(right, correct=right)


def calls_then_answers(text, seed):
    """Turn 1 calls add with the question's numbers; turn 2 answers the tool's result."""
    if "<tool_response>" not in text:
        a, b = text.split("<|im_start|>user\n")[-1].split("?")[0].split("+")
        return CALL.format(a=a, b=b)
    return text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]


def draws(*sums, source="test"):
    return [PromptDraw(PromptRow(f"row{i}", [{"role": "user", "content": "-"}], source, ground_truth=pair), [], i)
            for i, pair in enumerate(sums)]


def run(engine, tokenizer, draw_list, n=1, environment="test_adder", max_new_tokens=64, seed=7, **limits):
    cfg = AgentsConfig(environment=environment, limits=EpisodeLimits(**limits))
    runner = EpisodeRunner(engine, tokenizer, cfg)
    return runner.run(draw_list, n, SamplingParams(max_new_tokens=max_new_tokens, seed=seed, return_logprobs=True))
