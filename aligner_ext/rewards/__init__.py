"""Reward functions chosen by each row's `data_source` (base.py: the registry), and the manager that runs
them in worker processes (manager.py). Importing a function's module registers it; the manager imports
the general ones (`math_verify`: math_answer.py; `exact_match`, `squad_exact_match`: exact_match.py;
`multiple_choice`; `format_boxed`: format.py), aligner_ext/plugins.py also the rubric and MTPO segment
rewards. The package itself imports nothing, so that settings.py loads without torch."""
