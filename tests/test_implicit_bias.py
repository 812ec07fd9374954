"""Collects the implicit-bias study's smoke test, which lives with the study
(studies/implicit_bias/smoke_test.py), into the suite that CI runs (the README's test command)."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'studies',
                     'implicit_bias', 'smoke_test.py')
_SPEC = importlib.util.spec_from_file_location('implicit_bias_smoke_test', _PATH)
_STUDY = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_STUDY)

test_both_arms_record_finite_alignment_and_sequential_steps_k_times_per_sample = (
    _STUDY.test_both_arms_record_finite_alignment_and_sequential_steps_k_times_per_sample)
