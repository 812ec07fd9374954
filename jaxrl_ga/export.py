r"""Exports a trained policy from a checkpoint to a Hugging Face model directory.

  python -m jaxrl_ga.export --checkpoint=WORKDIR/checkpoints/grpo --out=/tmp/hf_model

--checkpoint is a stage's checkpoint directory (its latest step is used), one step's directory
(WORKDIR/checkpoints/grpo/12), or the run's WORKDIR (its most recently written stage). The model
config comes from the checkpoint; the tokenizer (its chat template included) from --tokenizer, or
WORKDIR/tokenizer when the checkpoint lies in WORKDIR/checkpoints/<stage>.
The output loads with transformers.AutoModelForCausalLM.from_pretrained(out).

LoRA checkpoints (model.lora.rank > 0) hold the adapters only: the base weights are rebuilt as
the run built them (model.hf_path's weights, or the seed's initialization; both in the
fingerprint) and the adapters merged into them (W + alpha/r A @ B in float32; jaxrl_ga.lora), so
--out is a plain HF model. --adapter_out also writes the adapters alone in PEFT's layout
(adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Optional

from absl import app
from absl import flags
from flax import nnx
import jax
import transformers

from jaxrl_ga import checkpoint
from jaxrl_ga import cli
from jaxrl_ga import fileio
from jaxrl_ga import lora
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.trainers import stage


def _define_flags():
  """CLI flags, defined only when run as a program (importing the module defines none)."""
  flags.DEFINE_string('checkpoint', None, 'A stage checkpoint directory, a step directory '
                      'inside one, or a run\'s workdir (its most recently written stage).')
  flags.DEFINE_string('out', None, 'Output directory for the HF model.')
  flags.DEFINE_string('tokenizer', None, 'Tokenizer directory or hub id (default: '
                      'WORKDIR/tokenizer next to the checkpoints).')
  flags.DEFINE_enum('weights_dtype', None, ['float32', 'bfloat16'],
                    'dtype of the written tensors (default: the params dtype; float32 for a '
                    'LoRA checkpoint on a bfloat16 base, whose merged update bfloat16 would '
                    'round away).')
  flags.DEFINE_string('adapter_out', None, 'LoRA checkpoints: also write the adapters alone '
                      'to this directory in PEFT\'s layout (adapter_config.json, '
                      'adapter_model.safetensors).')
  flags.DEFINE_bool('overwrite', False, 'Replace --out when it is a non-empty directory (the '
                    'whole directory: no file of an earlier export is left behind).')
  flags.mark_flags_as_required(['checkpoint', 'out'])


def load_checkpoint(checkpoint_dir: str, tokenizer_path: str | None = None):
  """(model config, params, tokenizer or None, 'DIR/STEP' read) of a checkpoint.

  checkpoint_dir: a stage checkpoint directory (its latest step), one step's directory
  (WORKDIR/checkpoints/grpo/12), or a run's WORKDIR (the stage whose latest checkpoint was written
  last). The tokenizer: ``tokenizer_path``, else WORKDIR/tokenizer when it exists.
  """
  return _read_checkpoint(checkpoint_dir, tokenizer_path)[:4]


def _read_checkpoint(checkpoint_dir: str, tokenizer_path: str | None = None):
  """``load_checkpoint``'s tuple and the checkpoint's fingerprint (what the run recorded)."""
  path = os.path.abspath(checkpoint_dir.rstrip('/'))
  stages = os.path.join(path, 'checkpoints')
  if os.path.isdir(stages):  # a run's workdir: its most recently written stage
    candidates = [os.path.join(stages, d) for d in os.listdir(stages)
                  if checkpoint.all_steps(os.path.join(stages, d))]
    if candidates:
      path = max(candidates, key=lambda d: os.path.getmtime(
          os.path.join(d, str(checkpoint.all_steps(d)[-1]))))
  step = None
  if os.path.basename(path).isdigit() and not checkpoint.all_steps(path):
    path, step = os.path.dirname(path), int(os.path.basename(path))
  steps = checkpoint.all_steps(path)
  if not steps:
    raise FileNotFoundError(f'no checkpoint under {checkpoint_dir}; pass a stage checkpoint '
                            f'directory such as WORKDIR/checkpoints/grpo.')
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f'no step {step} in {path}; available steps: {steps}.')
  state, meta, fingerprint = checkpoint.Checkpointer(path, read_only=True).restore_raw(step)
  if 'model' not in fingerprint:
    raise ValueError(f'{path}/{step} holds no model config in its fingerprint; was it written '
                     f'by jaxrl_ga.main?')
  cfg = policy.model_config_from_dict(fingerprint['model'])
  params = state['learner']['params'] if 'learner' in state else state['params']
  if cfg.lora.rank:  # the adapters only: on the base weights the run started from
    source = fingerprint.get('model_source')
    if source and meta.get('base_digest') and policy.weights_digest(source) != meta['base_digest']:
      raise ValueError(policy.BASE_CHANGED.format(source=source, where=f'{path}/{step}',
                                                     use='merged'))
    params = tfm.combine(base_params(cfg, fingerprint), params)
  tokenizer = None
  tok_path = tokenizer_path or os.path.join(os.path.dirname(os.path.dirname(path)), 'tokenizer')
  if tokenizer_path or os.path.isdir(tok_path):
    tokenizer = hf.load_tokenizer(tok_path)
  return (cfg, params, tokenizer, f'{path}/{step}', fingerprint,
          saved_generation_config(tokenizer))


def saved_generation_config(tokenizer) -> Optional[transformers.GenerationConfig]:
  """The generation config a run kept beside its tokenizer (WORKDIR/tokenizer, read from the
  directory ``tokenizer`` was loaded from; ``policy.run_generation_config``: the model's, with
  every eos id its completions stopped at), or None."""
  directory = getattr(tokenizer, 'name_or_path', None) or ''
  if not os.path.isfile(os.path.join(directory, transformers.utils.GENERATION_CONFIG_NAME)):
    return None
  return transformers.GenerationConfig.from_pretrained(directory)


def base_params(cfg, fingerprint: dict) -> dict:
  """The frozen base weights of a LoRA run, rebuilt as the run built them
  (models/policy.build_model): model.hf_path's weights, or the seed's initialization."""
  if fingerprint.get('model_source'):
    return policy.load_model(fingerprint['model_source'], dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype)[2]
  # The adapters are drawn after every base weight: the base model of the same seed.
  return tfm.split(tfm.Transformer(lora.base_config(cfg),
                                   rngs=nnx.Rngs(fingerprint['seed'])))[1]


def _merged_weights_dtype(params: dict, folded: dict, cfg,
                          weights_dtype: Optional[str]) -> Optional[str]:
  """The dtype of a LoRA export's tensors (``folded``: ``lora.merged(params, cfg)``'s): as
  asked, or float32 where the base is bfloat16 (the merged W + (alpha/r) A B rounded to bfloat16
  loses the updates under half an ulp of W, most of a small learning rate's). Prints the share
  of the update bfloat16 loses, whichever is written."""
  if cfg.param_dtype != 'bfloat16' or weights_dtype == 'float32':
    return weights_dtype
  loss = lora.bfloat16_loss(params, folded, cfg)
  if weights_dtype == 'bfloat16':
    print(f'export: --weights_dtype=bfloat16 rounds the merged weights; it loses {loss:.1%} of '
          f'the adapters\' update (norm); the default writes float32 for a bfloat16 base.',
          flush=True)
    return weights_dtype
  print(f'export: the base is bfloat16; the merged weights are written in float32 (in bfloat16 '
        f'{loss:.1%} of the adapters\' update would be lost; --weights_dtype=bfloat16 to write '
        f'bfloat16 anyway).', flush=True)
  return 'float32'


def check_out_dir(out_dir: str, overwrite: bool = False) -> None:
  """--out must be a new or empty directory, or ``overwrite`` is set; never a file."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f'--out={out_dir} is a file; give a directory path.')
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise ValueError(f'--out={out_dir} is not empty ({len(os.listdir(out_dir))} entries); pass '
                     f'--overwrite to replace it, or give a new directory.')


def export_checkpoint(checkpoint_dir: str, out_dir: str, tokenizer_path: str | None = None,
                      weights_dtype: str | None = None, overwrite: bool = False,
                      adapter_out: str | None = None) -> str:
  """Writes the HF directory (LoRA: the merged weights; ``adapter_out``: PEFT's adapter files
  too); returns the checkpoint step directory it read.

  The model is written into a new sibling directory that then takes ``out_dir``'s place, so a
  replaced export leaves no stale file (an old shard index would win over the new weights) and
  an export cut short leaves ``out_dir`` as it was. Files get the umask's permissions. In a
  multi-process job every process calls it (each reads the checkpoint) and process 0 alone
  writes.
  """
  out_dir = os.path.abspath(out_dir)

  def check():
    check_out_dir(out_dir, overwrite)
    if adapter_out:
      check_out_dir(adapter_out, overwrite)

  _on_primary('checking --out', check)
  # Every process reads (orbax's restore is collective in a multi-process job); process 0 writes.
  cfg, params, tokenizer, src, fingerprint, generation = _read_checkpoint(checkpoint_dir,
                                                                         tokenizer_path)
  if adapter_out and not cfg.lora.rank:
    raise ValueError(f'--adapter_out: {src} is not a LoRA checkpoint (model.lora.rank = 0).')
  _on_primary('the export', lambda: _write(cfg, params, tokenizer, generation, fingerprint,
                                           out_dir, weights_dtype, adapter_out))
  return src


def _on_primary(what: str, fn) -> None:
  """``fn`` on process 0 alone; a failure there stops every process of a multi-process job
  (``stage.on_every_process``), so that none writes twice, replaces process 0's files, or goes
  on alone."""
  stage.on_every_process(what, lambda: fn() if jax.process_index() == 0 else None,
                         catch=(Exception,))


def _write(cfg, params, tokenizer, generation, fingerprint, out_dir: str,
           weights_dtype: str | None, adapter_out: str | None) -> None:
  """The HF directory into a new sibling that then takes ``out_dir``'s place (see
  ``export_checkpoint``); LoRA: merged, and PEFT's adapter files with ``adapter_out``."""
  if cfg.lora.rank:
    if adapter_out:
      with fileio.writing(adapter_out):
        lora.save_peft(lora.split(params)[0], cfg, adapter_out,
                       base_model=fingerprint.get('model_source') or None)
    folded, base_cfg = lora.merged(params, cfg)
    weights_dtype = _merged_weights_dtype(params, folded, cfg, weights_dtype)
    params, cfg = folded, base_cfg
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  with fileio.writing(out_dir):
    staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.', dir=parent)
  try:
    with fileio.writing(out_dir):  # a full disk: one line naming out_dir, which stays as it was
      hf.export(params, cfg, staging, tokenizer=tokenizer, weights_dtype=weights_dtype,
                generation=generation)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    for root, _, files in os.walk(staging):
      for name in files:
        os.chmod(os.path.join(root, name), 0o666 & ~umask)
    old = None
    if os.path.exists(out_dir):
      old = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.old.', dir=parent)
      os.rename(out_dir, os.path.join(old, 'out'))
    os.rename(staging, out_dir)
    if old is not None:
      shutil.rmtree(old)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  cli.warnings_only_unless_asked()  # no orbax INFO lines (--verbosity=0 brings them)
  f = flags.FLAGS
  try:
    src = export_checkpoint(f.checkpoint, f.out, f.tokenizer, f.weights_dtype, f.overwrite,
                            f.adapter_out)
  except fileio.WriteError as e:  # a full disk: --out is left as it was
    print(f'error: {e}; --out={f.out} is unchanged. Free space, then run the export again.',
          file=sys.stderr)
    sys.exit(1)
  except (FileNotFoundError, ValueError, PermissionError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(f'exported {src} to {f.out}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
