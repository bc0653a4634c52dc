"""Imports every built-in plug-in module so that its registrations run.

`trainer/build.py` imports this module; a new built-in plug-in adds its module here and regenerates the
name table that settings are checked against (`python scripts/gen_plugin_names.py`). User plug-ins need
no entry: registries import dotted paths on demand.
"""

import aligner_ext.agents.calculator  # noqa: F401
import aligner_ext.agents.python_environment  # noqa: F401
import aligner_ext.agents.guess_number  # noqa: F401
import aligner_ext.algorithms.advantages  # noqa: F401
import aligner_ext.algorithms.cpo  # noqa: F401
import aligner_ext.algorithms.estimators  # noqa: F401
import aligner_ext.algorithms.mtpo  # noqa: F401
import aligner_ext.experience.agent_episodes  # noqa: F401
import aligner_ext.experience.base  # noqa: F401
import aligner_ext.experience.dynamic_sampling  # noqa: F401
import aligner_ext.experience.graded_prompt  # noqa: F401
import aligner_ext.experience.hint_logprobs  # noqa: F401
import aligner_ext.experience.overlong  # noqa: F401
import aligner_ext.experience.two_round  # noqa: F401
import aligner_ext.generation.hf  # noqa: F401
import aligner_ext.generation.remote  # noqa: F401
import aligner_ext.generation.rollout  # noqa: F401
import aligner_ext.generation.vllm_colocated  # noqa: F401 - registers the name only; vllm loads on use
import aligner_ext.losses.cispo  # noqa: F401
import aligner_ext.losses.clipped_pg  # noqa: F401
import aligner_ext.losses.gspo  # noqa: F401
import aligner_ext.models.hf  # noqa: F401
import aligner_ext.models.megatron  # noqa: F401 - registers the name only; megatron-core loads on use
import aligner_ext.rewards.exact_match  # noqa: F401
import aligner_ext.rewards.format  # noqa: F401
import aligner_ext.rewards.math_answer  # noqa: F401
import aligner_ext.rewards.multiple_choice  # noqa: F401
import aligner_ext.rewards.calibration  # noqa: F401
import aligner_ext.rewards.rubric  # noqa: F401
