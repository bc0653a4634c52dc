"""An agent function for the small end-to-end runs, loaded by dotted path `e2e_agents:calculator_agent`:
agent code as written for the OpenAI API, with a tool, run against the trainer's session endpoint.

Two turns every episode: the tool's results after a turn that calls it, else a user message asking
again, so every row holds an observation between two sampled turns. It returns None: the reward registry
scores the last turn."""

import json
from fractions import Fraction

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The expression."}},
                   "required": ["expression"]}}}


def evaluate(arguments: str) -> str:
    """A sum of the call's `expression`, or the error the agent answers with."""
    try:
        expression = json.loads(arguments)["expression"]
        return str(sum(Fraction(term) for term in str(expression).split("+")))
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        return f"Error: {err}"


async def calculator_agent(client, row):
    messages = list(row.messages)
    for turn in range(2):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message)
        if turn == 1:
            break
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": call.id, "content": evaluate(call.function.arguments)}
                         for call in message.tool_calls]
        else:
            messages.append({"role": "user", "content": "check it and answer again"})
    return None
