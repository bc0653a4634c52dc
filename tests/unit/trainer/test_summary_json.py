"""summary.json is strict JSON: a metric that is NaN (no held-out set, say) is written as null."""

import json
import math

from aligner_ext.trainer.loop import json_safe


def test_nan_and_inf_become_null_at_any_depth():
    value = {"accuracy": math.nan, "steps": 3, "means": {"a": math.inf, "b": 0.5}, "list": [1.0, -math.inf]}
    text = json.dumps(json_safe(value), allow_nan=False)  # raises if a NaN or inf is left
    assert json.loads(text) == {"accuracy": None, "steps": 3, "means": {"a": None, "b": 0.5}, "list": [1.0, None]}
