"""The bugs the exactness tests are known to catch, and the check that they still do.

Each mutant is one bug put into a scratch copy of the repository (the code is never changed in
place); the tests listed with it must fail on that copy. Run it when the exactness tests, or the
code they cover, change (minutes per mutant; from the repository root):

  python tests/mutants.py                        # every mutant
  python tests/mutants.py last_microbatch_denominator

It prints, per mutant, the module the tests imported (the copy's) and for each listed test its
failure message, and exits 1 if a listed test passed on the mutant. Which tests catch what:

  last_microbatch_denominator  the optimizer step divides the window's summed gradient by the last
      micro-batch's normalizer instead of the window's (a K-fold wrong step). Caught by the
      unclipped cases of test_grpo_accumulation_is_exact, test_accumulated_adapter_update_is_exact
      (LoRA), test_sft_accumulation_is_exact (K=3) and test_dpo_accumulation_is_exact: the applied
      gradient (AdamW's first moment, clipping off) is off by the ratio of the normalizers. The
      clipped case cannot see it (the clip sets the norm), nor K=1 (the last micro-batch is the
      window).
  applied_gradient_times_k  the summed gradient is multiplied by K before the inner optimizer
      (MultiSteps' use_grad_mean taken the wrong way round). Caught by the same tests, through the
      applied gradient (one case of each is run).
  grad_norm_last_microbatch  the grad_norm output divides by the last micro-batch's normalizer.
      Caught by the K > 1 exactness tests' grad_norm assertions, the clipped GRPO case included
      (the GRPO, SFT and DPO ones are run).
  clip_before_normalize  the clip acts on the summed gradient, before the division by the window's
      normalizer (the clip then scales by the wrong norm). Caught by the clipped case of
      test_grpo_accumulation_is_exact only (with clipping off the order does not matter).
  lora_trains_biases  lora.split puts the q/k/v biases with the adapters, so LoRA trains them too.
      Caught by test_accumulated_adapter_update_is_exact's structural assertions on the initial
      state, before any numeric check: what trains (float32 base), AdamW's moments not all float32
      (bfloat16 base: tests/learner_refs.py's check_structure). The numeric checks need not see
      it: the one-pass reference differentiates the same (mutated) trainable set.
  constant_normalizer_of_the_cut_width  aggregation 'constant' (Dr. GRPO) divides by the width the
      learner computed (grpo.length_buckets) instead of max_completion_length. Caught by
      test_learn_width's applied gradient against the full-width window loss.
  learner_width_ignored  the learner's micro-batch keeps every max_completion_length position.
      Caught by test_learn_width's check of the widths the learner's step receives (the update
      is the same, so no numeric check could see it).
  widths_compiled_mid_run  grpo.length_buckets' widths are not compiled before the loop (each
      compiles when a micro-batch first needs it). Caught by test_learn_width's count of the
      compiles each learner step finds already done.
  fingerprint_without_token_ids  preference.fingerprint hashes everything but the token ids (the
      masks, shapes and reference model only). Caught by test_preference's cache test, whose
      changed dataset has a reply of the same token length with other tokens: the resume must
      refuse the cache.
  dpo_ignores_no_shuffle  DPOStage.run on a preference dataset ignores data.shuffle=False (its pairs
      shuffled anyway). Caught by test_preference's DPO run, whose first micro-batch must hold
      pairs 0..B-1 in file order.
  logged_reward_of_another_row  completions.jsonl gives process 0's local completion j the total
      reward of global row j instead of its own (index[j]): the same on one process, another
      host's row's from the second slice on. Caught by test_two_processes_equal_one_process on a
      data file, which recomputes every logged completion's reward from its text and row.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_GRPO = 'tests/test_learner.py::test_grpo_accumulation_is_exact'
_GRPO_UNCLIPPED = tuple(f'{_GRPO}[{i}]' for i in (
    'token-1dev', 'sequence-8dev', 'constant-8dev', 'sequence-aligned', 'constant-iterations'))
_GRPO_CLIPPED = f'{_GRPO}[token-8dev-clipped]'
_LORA = tuple(f'tests/test_lora.py::test_accumulated_adapter_update_is_exact[{i}]'
              for i in ('mesh0-bfloat16', 'mesh1-float32'))
_WIDTH = ('tests/test_learn_width.py::'
          'test_learner_width_follows_the_longest_completion_and_the_update_is_the_full_widths')
_SFT_K3 = 'tests/test_learner_tasks.py::test_sft_accumulation_is_exact[3-mesh1]'
_PREF = 'tests/test_preference.py::'
_DPO = tuple(f'tests/test_learner_tasks.py::test_dpo_accumulation_is_exact[{i}]'
             for i in ('pair-mesh0', 'pair-mesh1', 'token-mesh2', 'token-mesh3'))
_TWO_HOSTS_DATA = 'tests/test_multihost.py::test_two_processes_equal_one_process[True]'


@dataclasses.dataclass(frozen=True)
class Mutant:
  path: str  # the file changed, relative to the repository root
  old: str  # occurs exactly once in it
  new: str
  caught_by: tuple[str, ...]  # pytest node ids that must fail on the mutant


MUTANTS = {
    'last_microbatch_denominator': Mutant(
        'jaxrl_ga/learner.py', "extra = {'denominator': window.denominator}",
        "extra = {'denominator': terms.denominator}",
        _GRPO_UNCLIPPED + _LORA + (_SFT_K3,) + _DPO),
    'applied_gradient_times_k': Mutant(
        'jaxrl_ga/learner.py', 'fire = lambda acc, rest, params: _fire(ms, acc, rest, params',
        'fire = lambda acc, rest, params: _fire(ms, jax.tree.map(lambda a: a * k, acc), rest, '
        'params', (_GRPO_UNCLIPPED[0], _LORA[0], _SFT_K3, _DPO[0])),
    'grad_norm_last_microbatch': Mutant(
        'jaxrl_ga/learner.py', "out['grad_norm'] = optax.tree.norm(summed) / denom",
        "out['grad_norm'] = optax.tree.norm(summed) / terms.denominator",
        (_GRPO_CLIPPED, _SFT_K3, _DPO[0])),
    'clip_before_normalize': Mutant(
        'jaxrl_ga/learner.py',
        '  inner = [normalize_by_denominator()]\n  if cfg.max_grad_norm > 0:\n'
        '    inner.append(optax.clip_by_global_norm(cfg.max_grad_norm))\n',
        '  inner = []\n  if cfg.max_grad_norm > 0:\n'
        '    inner.append(optax.clip_by_global_norm(cfg.max_grad_norm))\n'
        '  inner.append(normalize_by_denominator())\n',
        (_GRPO_CLIPPED,)),
    'lora_trains_biases': Mutant(
        'jaxrl_ga/lora.py', 'return key.endswith(_SUFFIXES)',
        "return key.endswith(_SUFFIXES + ('_bias',))", _LORA),
    'constant_normalizer_of_the_cut_width': Mutant(
        'jaxrl_ga/losses.py', 'jnp.asarray(num_rows * float(max_completion_length), jnp.float32)',
        'jnp.asarray(num_rows * float(mask.shape[-1]), jnp.float32)', (_WIDTH,)),
    'learner_width_ignored': Mutant(
        'jaxrl_ga/rollout.py', 'cut = lambda x: take(x)[:, :width]', 'cut = take', (_WIDTH,)),
    'widths_compiled_mid_run': Mutant(
        'jaxrl_ga/trainers/grpo.py', 'self._compile_widths(params, state)', 'pass', (_WIDTH,)),
    'fingerprint_without_token_ids': Mutant(
        'jaxrl_ga/preference.py', '  for key in sorted(pairs):',
        "  for key in sorted(k for k in pairs if not k.endswith('_tokens')):",
        (_PREF + 'test_reference_logps_are_cached_reused_and_a_changed_dataset_is_refused',)),
    'dpo_ignores_no_shuffle': Mutant(
        'jaxrl_ga/trainers/dpo.py',
        "shuffle = ctx.task.shuffle if cfg.pairs == 'dataset' else True", 'shuffle = True',
        (_PREF + 'test_a_dpo_run_starts_at_zero_rewards_on_pairs_in_file_order',)),
    'logged_reward_of_another_row': Mutant(
        'jaxrl_ga/trainers/grpo.py', "'reward': float(rewards[index[j]])",
        "'reward': float(rewards[j])", (_TWO_HOSTS_DATA,)),
}


def _copy_with(mutant: Mutant, dest: str) -> None:
  shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
      '.git', '__pycache__', '*.egg-info', '.pytest_cache', '.hypothesis'))
  path = os.path.join(dest, mutant.path)
  with open(path) as f:
    text = f.read()
  if text.count(mutant.old) != 1:
    raise SystemExit(f'error: {mutant.path} no longer holds the text the mutant replaces once; '
                     'update tests/mutants.py')
  with open(path, 'w') as f:
    f.write(text.replace(mutant.old, mutant.new))


def run(name: str) -> bool:
  """Runs the mutant's tests on a mutated copy; -> whether every one of them failed."""
  mutant = MUTANTS[name]
  with tempfile.TemporaryDirectory(prefix=f'mutant_{name}_') as tmp:
    copy = os.path.join(tmp, 'repo')
    _copy_with(mutant, copy)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [copy, os.path.join(copy, 'tests')] + os.environ.get('PYTHONPATH', '').split(os.pathsep)))
    imported = subprocess.run(
        [sys.executable, '-c', 'import jaxrl_ga; print(jaxrl_ga.__file__)'], env=env, cwd=copy,
        capture_output=True, text=True, check=True).stdout.strip()
    print(f'== {name}: {mutant.path}: {mutant.old.strip()!r} -> {mutant.new.strip()!r}')
    print(f'   jaxrl_ga imported from {imported}')
    if not imported.startswith(copy):
      raise SystemExit('error: the tests would not import the mutated copy')
    report = os.path.join(tmp, 'report.xml')
    subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                    f'--junitxml={report}', *mutant.caught_by], env=env, cwd=copy,
                   capture_output=True, text=True)
    failed = {}
    for case in ET.parse(report).getroot().iter('testcase'):
      node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
      bad = case.find('failure')
      if bad is None:
        bad = case.find('error')
      if bad is not None:
        lines = [l.strip() for l in (bad.get('message') or '').splitlines() if l.strip()]
        failed[node] = ' | '.join(lines[:4])  # assert_allclose's message starts with a newline
    ok = True
    for node in mutant.caught_by:
      if node in failed:
        print(f'   caught   {node}: {failed[node]}')
      else:
        print(f'   MISSED   {node}')
        ok = False
    return ok


def main(names) -> int:
  unknown = [n for n in names if n not in MUTANTS]
  if unknown:
    print(f'error: unknown mutant {unknown}; known: {", ".join(MUTANTS)}', file=sys.stderr)
    return 2
  results = [run(name) for name in names or MUTANTS]
  return 0 if all(results) else 1


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
