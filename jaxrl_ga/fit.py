"""Does it fit? Every compiled step's memory against the device's, before the first step.

A step needs what the compiler's own analysis says it holds at once, per device
(``compiled.memory_analysis()``): its arguments, its outputs that do not reuse a donated argument
and its temporaries (``step_bytes``; ``jaxrl_ga.plan`` reports the same number). The device has
(``device_limit``): ``mesh.device_memory_gib`` when set (> 0), else what the backend reports
(``memory_stats()['bytes_limit']``: GPUs and TPUs do), else the TPU chip's HBM
(``CHIPS``); with none of these (a plain CPU) nothing is checked and nothing changes.

``choose`` resolves the memory knobs of the training forward: ``model.remat='auto'`` and
``model.logprob_chunk_size=-1`` ('auto', ``AUTO_CHUNK``) take the cheapest setting whose steps
all fit, cheapest meaning least recompute: remat 'none' < 'save_dots' < 'full', and for each,
the log-probs all at once (chunk 0), else the largest power-of-two chunk that fits (memory falls
as the chunk does, so a bisection finds it). It prints one line with the choice. With explicit
settings that do not fit, or when no setting fits, it raises ConfigError (the CLI's one
``error:`` line, exit 2) naming the step, the bytes needed and available, and the knobs. With no
known limit 'auto' is remat 'none' and chunk 0, today's defaults, and nothing is compiled here.

Each candidate's steps are built by the caller's factory (``jaxrl_ga.programs``) and compiled
with ``lower(...).compile()``, which fills jax's compilation cache: the chosen programs' later
calls find their executables there, so nothing is compiled twice (tests/test_fit.py counts).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import jax

from jaxrl_ga.config import AUTO_CHUNK, REMAT, ModelSpec
from jaxrl_ga.errors import ConfigError

GIB = 2**30
_KNOBS = ('lower it with model.remat (none < save_dots < full: less memory, more recompute), '
          'model.logprob_chunk_size (-1: auto; e.g. 64), a smaller {batch} with a larger '
          '{accum} (the same update), or more devices in mesh.fsdp / mesh.tensor; or give '
          'mesh.device_memory_gib if the limit is wrong')


# Chip specs (public spec sheets, cloud.google.com/tpu/docs/<v4|v5e|v5p|v6e>): per-chip HBM, peak
# bf16 flop/s, HBM bandwidth (bytes/s). Keyed by the jax device_kind.
CHIPS = {
    'TPU v4': dict(name='v4', hbm_bytes=32 * 2**30, peak_flops=275e12, hbm_bandwidth=1228e9),
    'TPU v5 lite': dict(name='v5e', hbm_bytes=16 * 2**30, peak_flops=197e12,
                        hbm_bandwidth=819e9),
    'TPU v5': dict(name='v5p', hbm_bytes=95 * 2**30, peak_flops=459e12, hbm_bandwidth=2765e9),
    'TPU v5p': dict(name='v5p', hbm_bytes=95 * 2**30, peak_flops=459e12, hbm_bandwidth=2765e9),
    'TPU v6 lite': dict(name='v6e', hbm_bytes=32 * 2**30, peak_flops=918e12,
                        hbm_bandwidth=1640e9),
    # NVIDIA GPUs (benchmarks/accelerator.py's bounds; plan compiles for TPUs only): dense bf16
    # tensor-core flop/s (no sparsity) and HBM bandwidth of the SXM parts, from NVIDIA's data
    # sheets (nvidia.com/en-us/data-center/h100 and /h200, the A100 datasheet).
    'NVIDIA H200': dict(name='h200', hbm_bytes=141 * 10**9, peak_flops=989.4e12,
                        hbm_bandwidth=4.8e12),
    'NVIDIA H100 80GB HBM3': dict(name='h100', hbm_bytes=80 * 10**9, peak_flops=989.4e12,
                                  hbm_bandwidth=3.35e12),
    'NVIDIA A100-SXM4-80GB': dict(name='a100', hbm_bytes=80 * 10**9, peak_flops=312e12,
                                  hbm_bandwidth=2.039e12),
}


def compile_or_oom(lowered) -> tuple[Any, Optional[int], str]:
  """``lowered.compile()`` -> (executable, its ``step_bytes``, ''); a program the compiler
  rejects for memory (RESOURCE_EXHAUSTED: the TPU compiler's over-HBM check; on GPU the
  autotuner's allocation, seen on an H200 with jax 0.11.2) -> (None, the bytes it reported or
  None, its first line). Other errors propagate."""
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError: RESOURCE_EXHAUSTED)
    msg = str(e)
    if 'RESOURCE_EXHAUSTED' not in msg and 'hbm' not in msg.lower():
      raise
    # The TPU compiler's "Used 20.5G of 15.75G hbm"; the GPU autotuner's "Out of memory while
    # trying to allocate 200.02GiB" (one buffer: at least that).
    m = re.search(r'Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm', msg) or re.search(
        r'trying to allocate ([\d.]+)([KMGT])i?B', msg)
    need = int(float(m.group(1)) * 2**(10 * ' KMGT'.index(m.group(2)))) if m else None
    return None, need, msg.splitlines()[0][:400]
  return compiled, step_bytes(compiled), ''


def step_bytes(compiled) -> int:
  """Per-device bytes a compiled step holds at once (its memory analysis): arguments + outputs
  - aliased (donated) + temporaries, at least the compiler's own peak estimate."""
  mem = compiled.memory_analysis()
  return int(max(mem.argument_size_in_bytes + mem.output_size_in_bytes
                 - mem.alias_size_in_bytes + mem.temp_size_in_bytes,
                 getattr(mem, 'peak_memory_in_bytes', 0) or 0))


def device_limit(device_memory_gib: float, devices: Optional[Sequence[Any]] = None
                 ) -> Optional[tuple[int, str]]:
  """(bytes one device has for a step, where that comes from): ``device_memory_gib`` (> 0: the
  user's), else the backend's ``bytes_limit``, else a known TPU chip's HBM; None when nothing
  says (a plain CPU)."""
  if device_memory_gib:
    return int(device_memory_gib * GIB), f'mesh.device_memory_gib={device_memory_gib:g}'
  if devices is None:
    devices = jax.local_devices()
  device = devices[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (backends without memory stats)
    stats = {}
  if stats.get('bytes_limit'):
    return int(stats['bytes_limit']), f"the {device.device_kind}'s bytes_limit"
  if device.platform == 'tpu':
    chip = CHIPS.get(device.device_kind)
    return (chip['hbm_bytes'], f"the {device.device_kind}'s HBM") if chip else None
  return None


def say(line: str) -> None:
  """The console line of a choice (flushed, as the trainers' lines are)."""
  print(line, flush=True)


def remat_candidates(remat: str) -> tuple[str, ...]:
  return REMAT if remat == 'auto' else (remat,)


def chunk_candidates(chunk: int, positions: int) -> tuple[int, ...]:
  """0 (all at once), then the powers of two below ``positions``, largest first."""
  if chunk != AUTO_CHUNK:
    return (chunk,)
  sizes, c = [0], 1
  while c < positions:
    sizes.insert(1, c)
    c *= 2
  return tuple(sizes)


Build = Callable[[str, int], tuple[Any, Callable[[], list[tuple[str, Any]]]]]


def choose(spec: ModelSpec, build: Build, limit: Optional[tuple[int, str]], *, stage: str,
           positions: int, batch_setting: str, accum_setting: str,
           say: Callable[[str], None] = say) -> tuple[Any, str, int]:
  """The programs of the cheapest (remat, logprob_chunk_size) of ``spec`` that fit ``limit``.

  ``build(remat, chunk)`` -> (programs, a function that lowers their steps: [(step name,
  jax.stages.Lowered)], the largest first: the first that does not fit stops the candidate).
  ``positions``: the positions the log-prob chunks split (the chunk candidates are the powers of
  two below it). ``batch_setting`` / ``accum_setting``: the stage's micro-batch and accumulation
  settings, for the error's knobs. ``limit``: ``device_limit``'s. -> (programs, remat, chunk)."""
  remats = remat_candidates(spec.remat)
  chunks = chunk_candidates(spec.logprob_chunk_size, positions)
  if limit is None:  # nothing to compare with: the cheapest setting, nothing compiled here
    return build(remats[0], chunks[0])[0], remats[0], chunks[0]
  limit, source = limit
  tried: dict[tuple[str, int], tuple[Any, Optional[tuple[str, int]], tuple[str, int]]] = {}

  def attempt(remat, chunk):
    """-> (programs, (step, bytes) of the first step over the limit or None, the largest)."""
    if (remat, chunk) not in tried:
      programs, lower = build(remat, chunk)
      over, largest = None, ('', -1)
      for name, lowered in lower():
        compiled, need, _ = compile_or_oom(lowered)
        if compiled is None or need > limit:
          over = (name, need)
          break
        largest = max(largest, (name, need), key=lambda x: x[1])
      tried[remat, chunk] = (programs, over, largest)
    return tried[remat, chunk]

  for remat in remats:
    fitting = None
    if attempt(remat, chunks[0])[1] is None:
      fitting = chunks[0]
    elif len(chunks) > 1 and attempt(remat, chunks[-1])[1] is None:
      lo, hi = 1, len(chunks) - 1  # chunks[hi] fits; find the first (largest) that does
      while lo < hi:
        mid = (lo + hi) // 2
        if attempt(remat, chunks[mid])[1] is None:
          hi = mid
        else:
          lo = mid + 1
      fitting = chunks[hi]
    if fitting is not None:
      programs, _, (name, need) = tried[remat, fitting]
      if len(remats) > 1 or len(chunks) > 1:
        say(f'[{stage}] model.remat={spec.remat} -> {remat}, model.logprob_chunk_size='
            f'{_chunk_name(spec.logprob_chunk_size)} -> {fitting}: {name} '
            f'{size(need)} of {size(limit)} (compiler\'s memory_analysis)')
      return programs, remat, fitting
  # Nothing fits: name the least memory tried (the last remat's smallest chunk).
  remat, chunk = remats[-1], chunks[-1]
  name, need = attempt(remat, chunk)[1]
  needs = 'more than the compiler could fit' if need is None else size(need)
  auto = len(remats) > 1 or len(chunks) > 1
  setting = (f'model.remat={remat}, model.logprob_chunk_size={chunk}'
             + (' (the least memory of model.remat='
                f'{spec.remat}, model.logprob_chunk_size={_chunk_name(spec.logprob_chunk_size)})'
                if auto else ''))
  raise ConfigError(
      f'{stage}: the {name} needs {needs} per device (the compiler\'s memory_analysis) with '
      f'{setting}, but {size(limit)} are available ({source}); '
      + _KNOBS.format(batch=batch_setting, accum=accum_setting) + '.')


def size(n: int) -> str:
  """Bytes as GiB (MiB, KiB below one), two decimals."""
  for unit, scale in (('GiB', GIB), ('MiB', 2**20)):
    if n >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{n / 2**10:.2f} KiB'


def _chunk_name(chunk: int) -> str:
  return 'auto' if chunk == AUTO_CHUNK else str(chunk)
