"""DPO from a preference dataset (jaxrl_ga.preference, dpo.pairs='dataset').

The exactness test goes through the dataset path (api.build_context reads, checks and encodes the
JSONL; trainers/dpo.py computes and caches the reference log-probs and streams the micro-batches
in order) into the learner, and compares the gradient it applied at each optimizer step with a
one-pass reference written out here from the raw rows: the token rows built by hand from the
plain chat template (``role: content`` lines), the summed log-probs of a plain forward of the
model, the window loss of each loss type and aggregation in float64 (open-instruct's micro-batch
weighting split as the learner's micro-batches are), its gradient with respect to the summed
log-probs in float64, pulled back through the forward in float32.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import api
from jaxrl_ga import data
from jaxrl_ga import preference
from jaxrl_ga import programs
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, DPOConfig, DPOLossConfig, MeshConfig
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import tokenizer as tokenizer_lib
from jaxrl_ga.trainers import dpo

from learner_refs import OPT, applied_grad, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 32  # pairs per optimizer step: K micro-batches of WINDOW / K (8 data-parallel rows)
MAX_LENGTH = 64
TINY = {'model.hidden_size': 32, 'model.intermediate_size': 64, 'model.num_hidden_layers': 2,
        'model.num_attention_heads': 4, 'model.num_key_value_heads': 2,
        'model.max_position_embeddings': 96, 'mesh.data': 8, 'mesh.fsdp': 1, 'mesh.tensor': 1}


def _rows(n=2 * WINDOW + 8, seed=0):
  """Preference rows, chat conversations: implicit prompt (whole conversations), explicit prompt
  (messages), a multi-turn prompt with a system turn; replies of 1 to 38 characters, i.e. 3 to 40
  tokens after the template's newline and the eos."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    lc, lr = (int(x) for x in rng.integers(1, 39, 2))
    if i % 5 == 4:
      lc, lr = min(lc, 5), min(lr, 5)  # the prompt is 55 tokens
    chosen = {'role': 'assistant', 'content': ''.join(rng.choice(list('abcde'), lc))}
    rejected = {'role': 'assistant', 'content': ''.join(rng.choice(list('vwxyz'), lr))}
    user = {'role': 'user', 'content': f'q{i}'}
    if i % 5 == 4:  # a longer prompt: system, user, assistant, user
      prompt = [{'role': 'system', 'content': 's'}, user, {'role': 'assistant', 'content': 'ok'},
                {'role': 'user', 'content': 'more'}]
    else:
      prompt = [user]
    if i % 2:
      rows.append({'prompt': prompt, 'chosen': [chosen], 'rejected': [rejected]})
    else:
      rows.append({'chosen': prompt + [chosen], 'rejected': prompt + [rejected]})
  return rows


def _write(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
  return str(path)


def _config(train, **values):
  return api.make_config(None, **{
      'stages': 'dpo', 'dpo.pairs': 'dataset', 'data.train': train, 'data.shuffle': False,
      'data.eval_fraction': 0.1, 'dpo.max_length': MAX_LENGTH,
      'dpo.sampling.max_prompt_length': 48, 'dpo.micro_batch_size': 8, 'eval.num_examples': 2,
      **TINY, **values})


@pytest.fixture(scope='module')
def built(tmp_path_factory):
  """The dataset path up to the learner: the context and cached pairs (on the run's 8-device
  mesh), then the initial params, the reference's jitted forward and pull-back, and the mesh the
  learners here run on (one device: a fraction of the compile time; sharded accumulation is
  tests/test_learner_tasks.py's)."""
  tmp = tmp_path_factory.mktemp('pref')
  rows = _rows()
  train = _write(tmp / 'train.jsonl', rows)
  evalfile = _write(tmp / 'eval.jsonl', [{'prompt': 'q0', 'answer': '1'}])
  ctx, params = api.build_context(_config(train, **{'data.eval': evalfile}), str(tmp / 'wd'))
  pairs = dpo.load_or_build_pairs(ctx, ctx.cfg.dpo, params)
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  _, shapes, axes = sharding.abstract_model(ctx.model_cfg)
  shardings = sharding.param_shardings(shapes, axes, mesh)
  params = jax.device_put(jax.device_get(params), shardings)
  fwd = lambda p, c, r: (_summed_logps(ctx.graphdef, p, *c), _summed_logps(ctx.graphdef, p, *r))
  pullback = lambda p, c, r, cot: jax.vjp(lambda q: fwd(q, c, r), p)[1](cot)[0]
  return dict(ctx=ctx, params=params, pairs=pairs, rows=rows, mesh=mesh, shardings=shardings,
              fwd=jax.jit(fwd), pullback=jax.jit(pullback), results={})


# -- the independent reference --------------------------------------------------------------------
def _by_hand(tokenizer, row):
  """(tokens, completion mask) of chosen and rejected, from the plain template by hand."""
  if 'prompt' in row:
    prompt, replies = row['prompt'], (row['chosen'], row['rejected'])
  else:
    prompt = row['chosen'][:-1]
    replies = (row['chosen'][-1:], row['rejected'][-1:])
  prompt_text = ''.join(f'{m["role"]}: {m["content"]}\n' for m in prompt) + 'assistant: '
  ids = lambda s: tokenizer(s, add_special_tokens=False)['input_ids']
  out = []
  for reply in replies:
    p, c = ids(prompt_text), ids(reply[0]['content'] + '\n') + [tokenizer.eos_token_id]
    out.append((p + c, [0] * len(p) + [1] * len(c)))
  return out


def _padded(seqs):
  tokens = np.zeros((len(seqs), MAX_LENGTH), np.int32)
  attn, loss = np.zeros_like(tokens), np.zeros_like(tokens)
  for i, (t, m) in enumerate(seqs):
    tokens[i, :len(t)], attn[i, :len(t)], loss[i, :len(t)] = t, 1, m
  return tokens, attn, loss


def _summed_logps(graphdef, params, tokens, attn, loss):
  logits = tfm.merge(graphdef, params)(tokens, attn)[:, :-1]
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                           tokens[:, 1:, None], -1)[..., 0]
  return jnp.sum(lp * loss[:, 1:], axis=1)


def _window_loss64(lc, lr, rc, rr, nc, nr, lengths, cfg: DPOLossConfig, k: int):
  """The window loss in float64 (inside jax.enable_x64) of summed log-probs lc, lr [P]."""
  beta, ls = cfg.beta, cfg.label_smoothing
  h = (lc - rc) - (lr - rr)
  logsig = jax.nn.log_sigmoid
  per_pair = {
      'sigmoid': lambda: -(1 - ls) * logsig(beta * h) - ls * logsig(-beta * h),
      'ipo': lambda: ((lc - rc) / nc - (lr - rr) / nr - 1 / (2 * beta))**2,
      'hinge': lambda: jnp.maximum(0.0, 1 - beta * h),
      'robust': lambda: ((1 - ls) * -logsig(beta * h) + ls * logsig(-beta * h)) / (1 - 2 * ls),
  }[cfg.loss_type]()
  if cfg.aggregation == 'pair':
    loss = jnp.mean(per_pair)
  elif cfg.aggregation == 'token':
    loss = jnp.sum((nc + nr) * per_pair) / jnp.sum(nc + nr)
  else:  # open-instruct PR #1447: sum_k mean_k(loss) * N_k / sum_k N_k, N_k attention tokens
    n_k = lengths.reshape(k, -1).sum(1)
    loss = jnp.sum(per_pair.reshape(k, -1).mean(1) * n_k) / jnp.sum(n_k)
  if cfg.rpo_alpha:
    loss += cfg.rpo_alpha * -jnp.sum(lc) / jnp.sum(nc)
  return loss


def _reference(b, theta0, theta, rows, cfg: DPOLossConfig, k: int):
  """(window loss, its gradient at theta) over ``rows``, the reference policy theta0."""
  seqs = [_by_hand(b['ctx'].tokenizer, r) for r in rows]
  chosen, rejected = _padded([s[0] for s in seqs]), _padded([s[1] for s in seqs])
  rc, rr = (np.asarray(x, np.float64) for x in b['fwd'](theta0, chosen, rejected))
  lc, lr = b['fwd'](theta, chosen, rejected)
  nc, nr = (np.asarray(x[2].sum(1), np.float64) for x in (chosen, rejected))
  lengths = (chosen[1].sum(1) + rejected[1].sum(1)).astype(np.float64)
  with jax.enable_x64(True):
    f = lambda a, c: _window_loss64(a, c, rc, rr, nc, nr, lengths, cfg, k)
    args = (np.asarray(lc, np.float64), np.asarray(lr, np.float64))
    loss, (gc, gr) = jax.value_and_grad(f, argnums=(0, 1))(*args)
    loss, gc, gr = float(loss), np.asarray(gc), np.asarray(gr)
  cotangent = (jnp.asarray(gc, jnp.float32), jnp.asarray(gr, jnp.float32))
  return loss, b['pullback'](theta, chosen, rejected, cotangent)


def _train_two_windows(b, loss_cfg, k):
  """The learner on the dataset path's micro-batches, two optimizer steps. -> per window (the
  applied gradient's relative error, learner loss, reference loss, the applied gradient).
  Memoized in ``b`` (the tests share the runs, one compile each)."""
  if (loss_cfg, k) not in b['results']:
    b['results'][loss_cfg, k] = _train(b, loss_cfg, k)
  return b['results'][loss_cfg, k]


def _train(b, loss_cfg, k):
  ctx = b['ctx']
  cfg = DPOConfig(pairs='dataset', micro_batch_size=WINDOW // k, grad_accum_steps=k,
                  max_length=MAX_LENGTH, loss=loss_cfg, optimizer=OPT)
  learner = programs.build_dpo_learner(ctx.cfg, ctx.model_cfg, b['mesh'], b['shardings'],
                                       ctx.graphdef, dpo=cfg)
  stream = dpo.PairStream(b['pairs'], cfg, ctx.cfg.seed, b['mesh'], shuffle=False)
  state = learner.init(b['params'], stream.batch_at(0))
  theta0 = jax.device_get(b['params'])
  results = []
  for window in range(2):
    theta = jax.device_get(state.params)
    for micro in range(k):
      state, out = learner.step(state, stream.batch_at(window * WINDOW + micro * (WINDOW // k)))
    assert bool(out['stepped'])
    loss, g = _reference(b, theta0, theta, b['rows'][window * WINDOW:(window + 1) * WINDOW],
                         loss_cfg, k)
    applied = jax.device_get(applied_grad(state))
    results.append((rel_err(applied, g), float(out['loss']), loss, applied))
  return results


MICROBATCH_TOKEN = DPOLossConfig(loss_type='sigmoid', aggregation='microbatch_token')
_AGGREGATIONS = ('microbatch_token', 'token', 'pair')
_LOSSES = (dict(loss_type='sigmoid'), dict(loss_type='ipo'), dict(loss_type='hinge'),
           dict(loss_type='robust', label_smoothing=0.1, rpo_alpha=0.5))
# Every loss type at K = 1, 2 and 4, the aggregation rotating so that each aggregation also runs
# at every K (RPO on the robust rows); and the sigmoid open-instruct split at K = 4 as well.
CASES = [(DPOLossConfig(**loss, aggregation=_AGGREGATIONS[(i + j) % 3]), k)
         for i, loss in enumerate(_LOSSES) for j, k in enumerate((1, 2, 4))]
CASES.append((MICROBATCH_TOKEN, 4))
assert (MICROBATCH_TOKEN, 1) in CASES


@pytest.mark.parametrize('loss_cfg,k', CASES)
def test_dataset_dpo_update_equals_one_pass_float64_reference(built, loss_cfg, k):
  for window, (err, loss, ref_loss, _) in enumerate(_train_two_windows(built, loss_cfg, k)):
    print(f'{loss_cfg.loss_type} {loss_cfg.aggregation} rpo_alpha={loss_cfg.rpo_alpha} K={k} '
          f'window {window}: applied-gradient rel. error {err:.1e}, loss {loss:.6f} vs '
          f'{ref_loss:.6f}')
    assert err <= 1e-5, (err, loss_cfg, k)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_microbatch_token_depends_on_the_split_as_open_instruct_predicts(built):
  """open-instruct's weighting at K = 1 and 4 (the same 32 pairs per window): each run applied
  its own split's reference gradient (open-instruct's formula, previous test), and the two
  differ (the pairs' lengths vary)."""
  applied = {k: _train_two_windows(built, MICROBATCH_TOKEN, k)[1][3] for k in (1, 4)}
  print(f'microbatch_token: K=1 vs K=4 applied gradients differ by '
        f'{rel_err(applied[1], applied[4]):.2e} (relative)')
  assert rel_err(applied[1], applied[4]) > 1e-3


# -- the cache ----------------------------------------------------------------------------------
def test_reference_logps_are_cached_reused_and_a_changed_dataset_is_refused(built, tmp_path):
  ctx, pairs, rows = built['ctx'], built['pairs'], built['rows']
  path = preference.cache_path(ctx.workdir)
  cached = dict(np.load(path))
  assert str(cached.pop('fingerprint')) == ctx.task.fingerprint
  policy = str(cached.pop('policy'))
  assert set(cached) == set(pairs)
  # A resume reads the cache (marked here) instead of computing the log-probs again; so does
  # one of a cache written before the starting policy was stamped (no 'policy').
  marked = cached | {'ref_chosen_logps': np.full_like(cached['ref_chosen_logps'], -7.0),
                     'fingerprint': np.asarray(ctx.task.fingerprint)}
  wd = tmp_path / 'wd'
  os.makedirs(wd)
  train = ctx.cfg.data.train
  for stamp in ({'policy': np.asarray(policy)}, {}):
    np.savez(wd / preference.CACHE_FILE, **marked, **stamp)
    ctx2, params2 = api.build_context(ctx.cfg, str(wd))
    again = dpo.load_or_build_pairs(ctx2, ctx2.cfg.dpo, params2)
    np.testing.assert_array_equal(again['ref_chosen_logps'], -7.0)
  # Another starting policy (the seed's model) on the same rows: the reference log-probs are
  # computed again, not read (they were, with a run cut before its first DPO checkpoint).
  np.savez(wd / preference.CACHE_FILE, **marked, policy=np.asarray(policy))
  ctx3, params3 = api.build_context(api.make_config(ctx.cfg, seed=ctx.cfg.seed + 1), str(wd))
  assert ctx3.task.fingerprint == ctx.task.fingerprint  # the same pairs
  again = dpo.load_or_build_pairs(ctx3, ctx3.cfg.dpo, params3)
  assert not np.any(again['ref_chosen_logps'] == -7.0)
  assert np.abs(again['ref_chosen_logps'] - cached['ref_chosen_logps']).max() > 1e-3
  # One reply changed to another of the same token length (each letter the next: the masks and
  # lengths are the same, only token ids differ): refused before anything compiles, naming it.
  last = rows[-1]
  reply = last['rejected'][-1]['content']
  other = ''.join(chr(ord(c) + 1) if c != 'z' else 'v' for c in reply)
  edited = {**last, 'rejected': last['rejected'][:-1] + [{'role': 'assistant', 'content': other}]}
  masks = [_by_hand(ctx.tokenizer, r)[1][1] for r in (last, edited)]  # rejected's loss masks
  assert masks[0] == masks[1] and other != reply
  changed = _write(tmp_path / 'changed.jsonl', rows[:-1] + [edited])
  cfg = api.make_config(ctx.cfg, **{'data.train': changed})
  with pytest.raises(ConfigError) as e:
    api.build_context(cfg, str(wd))
  assert str(e.value).startswith(f'data.train: {wd}/{preference.CACHE_FILE} holds the pairs and '
                                 'reference log-probs of another dataset')
  assert train != changed


def test_a_dpo_run_starts_at_zero_rewards_on_pairs_in_file_order(built, tmp_path, monkeypatch):
  """A DPO run without dpo.ref_model, as TRL's first step: the policy is the reference, so every
  implicit reward is exactly 0: rewards/accuracies (a strict chosen > rejected) and margins read
  0, not float noise counted as wins, and the loss log 2. With data.shuffle=False the first
  micro-batch holds pairs 0..B-1 of the file, in order (the token rows built by hand).
  dpo.eval_every=1: held-out evaluations before, at step 1 and after the last (2)."""
  ctx = built['ctx']
  cfg = api.make_config(ctx.cfg, **{'dpo.num_steps': 2, 'dpo.grad_accum_steps': 1,
                                    'dpo.log_every': 1, 'dpo.eval_every': 1,
                                    'checkpoint.every_steps': 0})
  batches = []
  batch_at = dpo.PairStream.batch_at
  monkeypatch.setattr(dpo.PairStream, 'batch_at', lambda self, position: batches.append(
      (position, batch_at(self, position))) or batches[-1][1])
  api.run(cfg, str(tmp_path / 'wd'))
  b = cfg.dpo.micro_batch_size
  position, first = batches[0]
  seqs = [_by_hand(ctx.tokenizer, r) for r in built['rows'][:b]]
  for side, want in (('chosen', _padded([s[0] for s in seqs])),
                     ('rejected', _padded([s[1] for s in seqs]))):
    for key, value in zip(('tokens', 'attention_mask', 'loss_mask'), want):
      np.testing.assert_array_equal(jax.device_get(first[f'{side}_{key}']), value,
                                    err_msg=f'{side}_{key}')
  assert position == 0
  logged = [json.loads(l) for l in open(tmp_path / 'wd' / 'metrics.jsonl')]
  step1 = [l for l in logged if l['phase'] == 'dpo' and l['step'] == 1]
  assert len(step1) == 1, logged
  m = step1[0]
  assert (m['rewards/accuracies'], m['rewards/margins'], m['rewards/chosen'],
          m['rewards/rejected']) == (0.0, 0.0, 0.0, 0.0), m
  np.testing.assert_allclose(m['loss'], np.log(2.0), rtol=1e-6)
  assert [l['step'] for l in logged if l['phase'] == 'dpo_eval'] == [0, 1, 2]


def test_step_one_rewards_are_zero_and_true_differences_still_count(built):
  """The learner's step on one micro-batch of the file's pairs at the starting weights: with
  ref_is_policy (PairStream's first window) every implicit reward is 0; with the cached reference
  log-probs moved by one nat, pairs 0..3 towards chosen and 4..7 towards rejected, accuracies read
  exactly 0.5 and the rewards beta times the shifts."""
  ctx, b = built['ctx'], 8
  cfg = DPOConfig(pairs='dataset', micro_batch_size=b, grad_accum_steps=1, max_length=MAX_LENGTH,
                  optimizer=OPT)
  learner = programs.build_dpo_learner(ctx.cfg, ctx.model_cfg, built['mesh'], built['shardings'],
                                       ctx.graphdef, dpo=cfg)
  stream = dpo.PairStream(built['pairs'], cfg, ctx.cfg.seed, built['mesh'], shuffle=False)
  first = stream.batch_at(0)
  assert (stream.reference_is_policy(0), stream.reference_is_policy(b)) == (True, False)
  _, out = learner.step(learner.init(built['params'], first), first)
  assert [float(out[k]) for k in ('rewards/accuracies', 'rewards/margins', 'rewards/chosen',
                                  'rewards/rejected')] == [0.0] * 4
  half = np.arange(b) < b // 2
  shifted = dict(jax.device_get(first), ref_is_policy=np.zeros(b, bool))
  shifted['ref_chosen_logps'] = shifted['ref_chosen_logps'] - half
  shifted['ref_rejected_logps'] = shifted['ref_rejected_logps'] - ~half
  _, out = learner.step(learner.init(built['params'], first), shifted)
  beta = cfg.loss.beta
  assert float(out['rewards/accuracies']) == 0.5
  np.testing.assert_allclose([float(out[k]) for k in ('rewards/chosen', 'rewards/rejected',
                                                      'rewards/margins')],
                             [beta / 2, beta / 2, 0.0], atol=1e-5)


def test_a_separate_reference_model(built, tmp_path):
  """dpo.ref_model: the reference log-probs are that model's (here another initialization of
  the same architecture, exported as an HF directory), by the reference forward; it is part of
  the cache's fingerprint; a model with another vocabulary is refused before anything runs."""
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  ctx = built['ctx']
  _, other, _ = sharding.init_params(ctx.model_cfg, seed=7, mesh=built['mesh'])
  hf.export(other, ctx.model_cfg, str(tmp_path / 'ref'))
  cfg = api.make_config(ctx.cfg, **{'dpo.ref_model': str(tmp_path / 'ref')})
  ctx2, params2 = api.build_context(cfg, str(tmp_path / 'wd'))
  assert ctx2.task.fingerprint != ctx.task.fingerprint
  pairs = dpo.load_or_build_pairs(ctx2, cfg.dpo, params2)
  rows = [_by_hand(ctx.tokenizer, r) for r in built['rows'][:8]]
  c, r = _padded([x[0] for x in rows]), _padded([x[1] for x in rows])
  want_c, want_r = built['fwd'](jax.device_get(other), c, r)
  np.testing.assert_allclose(pairs['ref_chosen_logps'][:8], want_c, rtol=1e-5)
  np.testing.assert_allclose(pairs['ref_rejected_logps'][:8], want_r, rtol=1e-5)
  assert np.abs(pairs['ref_chosen_logps'] - built['pairs']['ref_chosen_logps']).min() > 1e-3
  small = dataclasses.replace(ctx.model_cfg, vocab_size=ctx.model_cfg.vocab_size - 1)
  _, params_small, _ = sharding.init_params(small, seed=0, mesh=built['mesh'])
  hf.export(params_small, small, str(tmp_path / 'small'))
  with pytest.raises(ConfigError) as e:
    api.build_context(api.make_config(ctx.cfg, **{'dpo.ref_model': str(tmp_path / 'small')}),
                      str(tmp_path / 'wd2'))
  assert str(e.value) == (f'dpo.ref_model={tmp_path}/small: a vocabulary of '
                          f'{small.vocab_size} tokens, the policy\'s has '
                          f'{ctx.model_cfg.vocab_size}; give a reference model with the '
                          f'policy\'s tokenizer.')


def test_dpo_trainer_on_rows_reads_them_as_preferences():
  rows = _rows(4)
  trainer = api.DPOTrainer(train_dataset=rows, config={'dpo': {'max_length': MAX_LENGTH}})
  assert trainer.config.dpo.pairs == 'dataset'
  task = data.build_task(trainer.config, train_dataset=rows)
  assert [p.where for p in task.preferences] == [f'data.train row {i}' for i in range(4)
                                                 if f'data.train row {i}' not in {
                                                     r.where for r in task.eval_rows}]
  assert api.DPOTrainer().config.dpo.pairs == 'sampled'


# -- bad input -------------------------------------------------------------------------------------------
def test_bad_preference_rows_name_the_row(tmp_path):
  good = _rows(8)
  conv = lambda *turns: [{'role': r, 'content': c} for r, c in turns]
  cases = [
      ({'prompt': 'q', 'chosen': 'a'}, ':9: no "rejected" column (columns: prompt, chosen); a '
       'preference row needs chosen and rejected; rename a column with '
       'data.columns=<name>:rejected.'),
      ({'prompt': 'q', 'chosen': 'a', 'rejected': ' '},
       ':9: an empty rejected reply; give a non-empty completion.'),
      ({'prompt': 'q', 'chosen': conv(('assistant', '')), 'rejected': 'b'},
       ':9: an empty chosen reply; give a non-empty completion.'),
      ({'chosen': conv(('user', 'q'), ('assistant', 'a')), 'rejected': conv(('user', 'q'))},
       ':9: the rejected conversation has no assistant turn after the prompt (roles: none); the '
       'reply must be an assistant message.'),
      ({'prompt': 'q', 'chosen': conv(('user', 'a')), 'rejected': conv(('assistant', 'b'))},
       ':9: the chosen conversation has no assistant turn after the prompt (roles: user); the '
       'reply must be an assistant message.'),
      ({'chosen': conv(('user', 'q'), ('assistant', 'a')),
        'rejected': conv(('user', 'p'), ('assistant', 'b'))},
       ':9: no "prompt" column, and chosen and rejected share no leading turn to be the prompt; '
       'add a "prompt" column.'),
      ({'chosen': 'a', 'rejected': 'b'}, ':9: no "prompt" column; string replies need one '
       '(conversations in chosen and rejected may share their leading turns instead).'),
      ({'prompt': 'q', 'chosen': 3, 'rejected': 'b'}, ':9: "chosen" is a int (\'3\'); give a '
       'string or a list of chat messages {"role": ..., "content": ...}.'),
      ({'prompt': 'q', 'chosen': 'same', 'rejected': 'same'},
       ':9: chosen equals rejected; a pair needs two different replies.'),
  ]
  for bad, message in cases:
    path = _write(tmp_path / 'bad.jsonl', good + [bad])
    with pytest.raises(ConfigError) as e:
      data.build_task(_config(path))
    assert str(e.value) == f'data.train={path}{message}', bad
  with pytest.raises(ConfigError) as e:
    data.build_task(api.make_config(None, **{'stages': 'dpo', 'dpo.pairs': 'dataset'}))
  assert str(e.value).startswith('dpo.pairs=dataset needs data.train')
  with pytest.raises(ConfigError) as e:
    data.build_task(_config(path, stages='sft,dpo'))
  assert str(e.value).startswith('stages=sft,dpo: with dpo.pairs=dataset, data.train holds '
                                 'preference rows')


def test_string_replies_ending_with_eos_get_no_second_eos():
  """Without a chat template: each reply followed by the eos unless it ends with it (TRL 1.16's
  dpo_trainer.py add_eos), the ids the tokenizer's of that text."""
  tok = tokenizer_lib.build_char_tokenizer(data.BASE_ALPHABET)
  tok.chat_template = None
  eos = tok.eos_token
  row = data.Row(prompt='q', chosen='yes' + eos, rejected='no')
  row.where = 'pref.jsonl:1'
  _, chosen, rejected = preference.encode_row(tok, preference.parse(row, {}), tok.eos_token_id)
  trl = lambda s: tok(s if s.endswith(eos) else s + eos, add_special_tokens=False)['input_ids']
  assert chosen == trl('yes' + eos) and chosen.count(tok.eos_token_id) == 1
  assert rejected == trl('no') and rejected[-1] == tok.eos_token_id


def test_a_base_models_prompt_starts_with_its_bos():
  """Without a chat template the prompt is tokenized as TRL 1.16 tokenizes non-conversational
  text (processing_class(text=...)): a base Llama's BOS first; the replies get none."""
  import transformers  # pylint: disable=import-outside-toplevel
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, 'tests/fixtures/llama_tiny'))
  tok.add_bos_token = True
  row = data.Row(prompt='q', chosen='yes', rejected='no')
  row.where = 'pref.jsonl:1'
  prompt, chosen, _ = preference.encode_row(tok, preference.parse(row, {}), tok.eos_token_id)
  assert prompt == tok('q')['input_ids'] and prompt[0] == tok.bos_token_id
  assert chosen == tok('yes' + tok.eos_token, add_special_tokens=False)['input_ids']


def test_a_chat_template_that_raises_names_the_row():
  """A template's own raise_exception on a reply (the prompt alone renders): one ConfigError line
  naming the row, not the template engine's error."""
  tok = tokenizer_lib.build_char_tokenizer(data.BASE_ALPHABET)
  tok.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}"
                       "{{ raise_exception('this template takes no assistant turn') }}{% endif %}"
                       "{{ m.role }}: {{ m.content }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant: {% endif %}")
  row = data.Row(prompt='q', chosen='a', rejected='b')
  row.where = 'pref.jsonl:3'
  with pytest.raises(ConfigError) as e:
    preference.encode_row(tok, preference.parse(row, {}), tok.eos_token_id)
  assert str(e.value) == ('pref.jsonl:3: the chat template cannot render this conversation '
                          '(this template takes no assistant turn).')


def _cli(tmp_path, rows):
  path = _write(tmp_path / 'bad.jsonl', rows)
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', f'--workdir={tmp_path / "wd"}',
       '--config=configs/dpo_arith.py:smoke', '--config.stages=dpo', '--config.dpo.pairs=dataset',
       f'--config.data.train={path}', '--config.dpo.max_length=64',
       '--config.dpo.sampling.max_prompt_length=48'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  return done.returncode, done.stderr.strip().splitlines(), path


def test_bad_preference_rows_cli_one_line_exit_2(tmp_path):
  """Through the CLI, before anything compiles: a prompt over the length limit, found encoding
  the rows with the tokenizer, the last check before the run starts (the errors found reading
  the rows, equal replies among them, are the previous test's, raised by the same parse)."""
  good = _rows(8)
  rc, lines, path = _cli(tmp_path, good + [{'prompt': 'x' * 70, 'chosen': 'a', 'rejected': 'b'}])
  # 'user: ' + 70 characters + '\nassistant: ' through the plain chat template: 88 tokens.
  assert (rc, lines) == (2, [
      f'error: data.train={path}:9: a prompt of 88 tokens, over dpo.max_length - 1=63; raise it, '
      f'or set dpo.long_prompts=drop or truncate.']), lines
  assert not (tmp_path / 'wd' / 'checkpoints').exists()
  assert not (tmp_path / 'wd' / preference.CACHE_FILE).exists()


def test_long_prompts_dropped_or_truncated(built, tmp_path):
  ctx = built['ctx']
  long_row = {'prompt': 'x' * 70, 'chosen': 'a', 'rejected': 'b'}
  train = _write(tmp_path / 'long.jsonl', _rows(8) + [long_row])
  task = data.build_task(_config(train, **{'data.eval': ctx.cfg.data.eval}))
  task.encode(ctx.tokenizer, DPOConfig(max_length=MAX_LENGTH, long_prompts='drop'))
  assert (task.dropped, len(task.pairs['chosen_tokens'])) == (1, 8)
  as_messages = {'prompt': [{'role': 'user', 'content': 'x' * 70}],
                 'chosen': [{'role': 'assistant', 'content': 'a'}],
                 'rejected': [{'role': 'assistant', 'content': 'b'}]}
  (tokens, mask), _ = _by_hand(ctx.tokenizer, as_messages)
  prompt, reply = tokens[:mask.index(1)], tokens[mask.index(1):]
  for side in ('left', 'right'):
    task.encode(ctx.tokenizer, DPOConfig(max_length=MAX_LENGTH, max_prompt_length=40,
                                         long_prompts='truncate', truncation_side=side))
    want = (prompt[-40:] if side == 'left' else prompt[:40]) + reply
    assert task.pairs['chosen_tokens'][8][:len(want)].tolist() == want, side
    assert task.pairs['chosen_loss_mask'][8].tolist() == [0] * 40 + [1] * len(reply) + [0] * (
        MAX_LENGTH - len(want))


def test_smollm2_preference_config_and_script_fit_without_truncation(tmp_path, monkeypatch):
  """The shipped example: the script's rows parse as implicit-prompt conversations, and through
  SmolLM2's own chat template every prompt (43 tokens) and reply fit the config's lengths, each
  reply ending in the tokenizer's eos; held-out rows are other problems."""
  from jaxrl_ga.models import policy  # pylint: disable=g-import-not-at-top
  subprocess.run([sys.executable, os.path.join(ROOT, 'studies', 'your_data',
                                               'make_preference_jsonl.py'), f'--out={tmp_path}'],
                 check=True, capture_output=True, timeout=60)
  monkeypatch.syspath_prepend(str(tmp_path))  # the reward module, as PYTHONPATH=DIR does
  cfg = api.make_config(os.path.join(ROOT, 'configs', f'dpo_smollm2_preferences.py:{tmp_path}'))
  assert (cfg.stages, cfg.dpo.pairs) == (('dpo',), 'dataset')
  task = data.build_task(cfg)
  assert len(task.preferences) == 52 and len(task.eval_rows) == 48
  assert not {p.prompt[0]['content'] for p in task.preferences} & {
      r['prompt'] for r in task.eval_rows}
  tokenizer = policy.load_tokenizer(cfg.model.hf_path)
  task.encode(tokenizer, cfg.dpo)
  assert (task.dropped, task.truncated) == (0, 0)
  pairs = task.pairs
  prompt_tokens = pairs['chosen_attention_mask'].sum(1) - pairs['chosen_loss_mask'].sum(1)
  assert set(prompt_tokens.tolist()) == {43}
  for side in ('chosen', 'rejected'):
    for tokens, mask in zip(pairs[f'{side}_tokens'], pairs[f'{side}_loss_mask']):
      assert tokenizer.eos_token_id in tokens[mask > 0].tolist()


def test_sampled_pairs_of_other_settings_are_sampled_again(tmp_path, capsys):
  """dpo_pairs.npz outlives a run cut before its first DPO checkpoint (no stage fingerprint to
  refuse a changed config then): resumed with dpo.num_prompts=16 it trained on the 32 prompts'
  stale pairs. The cache carries what it was sampled from and is sampled again otherwise."""
  import shutil  # pylint: disable=import-outside-toplevel  # lazy: this test only
  import smoke_configs  # pylint: disable=import-outside-toplevel
  quick = {'stages': ('dpo',), 'dpo.num_steps': 1, 'eval.num_examples': 4, 'eval.batch_size': 4}
  api.run(smoke_configs.smoke('dpo_arith', **quick), str(tmp_path))
  pairs = lambda: len(np.load(tmp_path / 'dpo_pairs.npz')['ref_chosen_logps'])
  assert pairs() == 32  # the smoke config's num_prompts
  shutil.rmtree(tmp_path / 'checkpoints' / 'dpo')  # cut before its first checkpoint
  capsys.readouterr()
  api.run(smoke_configs.smoke('dpo_arith', **quick, **{'dpo.num_prompts': 16}), str(tmp_path))
  assert 'was sampled under other settings; sampling the pairs again' in capsys.readouterr().out
  assert pairs() == 16


def test_tool_calls_reasoning_and_the_tools_column_reach_the_template():
  """TRL 1.16's DPO tokenize_fn passes the row's "tools" (JSON text decoded) and
  "chat_template_kwargs" to apply_chat_template, and the messages whole. Reference: the
  template rendered by transformers with them; the prompt is the render with the generation
  prompt and the chosen reply what the whole conversation adds (its eos included, as the
  template writes eos here). Before, the tools, the flag, the reply's tool call and its
  reasoning were all dropped from what DPO trained on."""
  tok = tokenizer_lib.build_char_tokenizer(data.BASE_ALPHABET)
  tok.chat_template = (
      "{% if brief %}[brief]\n{% endif %}{% if tools %}tools:{% for t in tools %} "
      "{{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}{% for m in messages %}{{ m.role }}: "
      "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
      "{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>"
      "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
  tools = [{'type': 'function', 'function': {'name': 'add', 'parameters': {}}}]
  prompt = [{'role': 'user', 'content': 'What is 2+3?'}]
  chosen = [{'role': 'assistant', 'content': 'Let me add.', 'reasoning_content': 'use add',
             'tool_calls': [{'type': 'function', 'function': {'name': 'add', 'arguments': {}}}]}]
  rejected = [{'role': 'assistant', 'content': 'It is 6.'}]
  row = data.Row(prompt=prompt, chosen=chosen, rejected=rejected, tools=json.dumps(tools),
                 chat_template_kwargs={'brief': True})
  row.where = 'pref.jsonl:1'
  got = preference.encode_row(tok, preference.parse(row, {}), tok.eos_token_id)
  render = lambda m, gen: tok.apply_chat_template(m, tools=tools, brief=True, tokenize=False,
                                                  add_generation_prompt=gen)
  head = render(prompt, True)
  assert head == '[brief]\ntools: add\nuser: What is 2+3?\nassistant: '
  eos = tok.eos_token
  assert tok.decode(got[0]) == head
  assert tok.decode(got[1]) == render(prompt + chosen, False)[len(head):] + eos
  assert tok.decode(got[1]) == f'<think>use add</think>Let me add.<call>add</call>\n{eos}'
  assert tok.decode(got[2]) == f'It is 6.\n{eos}'


# Gemma 3's template, reduced: turns end with <end_of_turn> and a newline, not with the eos; the
# assistant's role is 'model'; contents are trimmed.
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_like_tokenizer():
  """A character tokenizer with Gemma 3's turn tokens and template; -> (tokenizer, the ids its
  model's sampling stops at: the eos, then <end_of_turn>, as Gemma 3's generation config)."""
  tok = tokenizer_lib.build_char_tokenizer(data.BASE_ALPHABET)
  tok.add_special_tokens({'additional_special_tokens': ['<start_of_turn>', '<end_of_turn>']})
  tok.chat_template = GEMMA_LIKE_TEMPLATE
  return tok, (tok.eos_token_id, tok.convert_tokens_to_ids('<end_of_turn>'))


def test_a_conversational_reply_ends_as_the_template_ends_it_without_an_added_eos():
  """TRL 1.16's DPO adds no eos to conversational rows: a reply is the text the template writes
  after the prompt (Gemma 3's ends '<end_of_turn>\\n'). The reference is transformers' render of
  the conversation minus the prompt's. Before, the tokenizer's <eos> was appended after Gemma's
  turn end, a token TRL's pair does not have."""
  tok, stops = gemma_like_tokenizer()
  prompt = [{'role': 'user', 'content': 'What is 2+2?'}]
  row = data.Row(prompt=prompt, chosen=[{'role': 'assistant', 'content': 'It is 4.'}],
                 rejected=[{'role': 'assistant', 'content': 'It is 5.'}])
  row.where = 'pref.jsonl:1'
  head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
  _, chosen, rejected = preference.encode_row(tok, preference.parse(row, {}), stops)
  for got, reply in ((chosen, row['chosen']), (rejected, row['rejected'])):
    whole = tok.apply_chat_template(prompt + reply, tokenize=False)
    assert whole.startswith(head) and whole.endswith('<end_of_turn>\n')
    assert got == tok(whole[len(head):], add_special_tokens=False)['input_ids']
    assert tok.eos_token_id not in got


def test_a_string_sft_reply_through_the_template_ends_with_the_turns_end_token():
  """A string completion after a templated prompt (a built-in task's SFT target, a string
  prompt-completion row, DPO's reference_as_chosen) is trained as the template's assistant turn,
  up to the token sampling stops at: Gemma 3's '<end_of_turn>', as the sampled replies end and as
  TRL's SFTTrainer trains the same example as a conversation (its trailing newline, after the
  stop, aside). Before: the raw completion and <eos>, a terminator Gemma's template never
  writes, and in DPO's reference_as_chosen pairs a last token the sampled rejected replies never
  had."""
  from jaxrl_ga import sft_data  # pylint: disable=import-outside-toplevel
  from jaxrl_ga.trainers import text  # pylint: disable=import-outside-toplevel
  tok, stops = gemma_like_tokenizer()
  user = [{'role': 'user', 'content': 'What is 2+2?'}]
  head = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
  whole = tok.apply_chat_template(user + [{'role': 'assistant', 'content': ' 4'}], tokenize=False)
  want = tok(whole[len(head):].removesuffix('\n'), add_special_tokens=False)['input_ids']
  assert tok.decode(want) == '4<end_of_turn>'
  row = data.Row(prompt='What is 2+2?', completion=' 4')
  row.where = 'sft.jsonl:1'
  ids, mask = sft_data.encode_row(tok, sft_data.check_row(row), stops)
  assert ids == tok(head, add_special_tokens=False)['input_ids'] + want
  assert [i for i, m in zip(ids, mask) if m] == want
  assert text.encode_reply(tok, 'What is 2+2?', ' 4', stops) == want
  # Without a template, or one whose turns end in no stop id: the completion and the eos.
  tok.chat_template = None
  assert text.encode_reply(tok, 'What is 2+2?', ' 4', stops) == tok(
      ' 4' + tok.eos_token, add_special_tokens=False)['input_ids']
