"""Generation: the public calls and the program registry (programs.py), their settings (options.py, sampling.py),
host-side preparation (prepare.py, buckets.py), the two programs (prefill.py, loop.py, with one draft step for either
drafter kind in draft_step.py and draft trees in tree.py), running a prepared call (call.py) and the result type
(result.py)."""
