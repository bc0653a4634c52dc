"""Agents: multi-turn rollouts in which the policy calls tools or answers an environment.

So far the building blocks only (docs/agents.md says what exists and what does not yet): the
environment interface and its registry (environment.py), tools from typed Python functions and their
runner (tools.py), the environment made of such tools alone (tool_environment.py), tool calls read
from sampled text per model family (tool_calls.py), token-exact trajectories from sampled ids and
rendered observations (tokens.py), and the built-in environments (calculator.py, guess_number.py).
"""
