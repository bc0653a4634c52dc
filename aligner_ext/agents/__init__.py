"""Agents: multi-turn rollouts in which the policy calls tools or answers an environment.

So far the building blocks only (docs/agents.md says what exists and what does not yet): the
environment interface and its registry (environment.py), tools from typed Python functions and their
runner (tools.py), tool calls read from sampled text per model family (tool_calls.py), and
token-exact trajectories from sampled ids and rendered observations (tokens.py).
"""
