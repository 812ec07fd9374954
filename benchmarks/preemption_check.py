r"""The host stall of the per-micro-step preemption check on several processes: the old check
(all-gather of the stop flag, ``PreemptionGuard.should_stop``) against the current one (jax's
preemption service, ``PreemptionGuard.should_stop_at``), in the same processes, interleaved.

  python benchmarks/preemption_check.py --out=benchmarks/results/preemption_check.json

Starts NUM_PROCESSES local processes (jax.distributed on 127.0.0.1, gloo CPU collectives, 2 CPU
devices each). Each iteration is what a training loop does: dispatch a jitted sharded step
(matmuls, asynchronous), do HOST_MS of host work (building the next batch), then ask the guard.
An all-gather blocks the host until the step and the other processes are done, so host work and
device work add up; the service's look-up does not block, so they overlap.
"""

import json
import os
import socket
import subprocess
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrl_ga import host_memory  # pylint: disable=g-import-not-at-top,wrong-import-position

_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 2, 'Local processes.')
_ITERS = flags.DEFINE_integer('iters', 30, 'Iterations per round.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds (old and new interleaved).')
_HOST_MS = flags.DEFINE_float('host_ms', 30.0, 'Host work per iteration (ms).')
_SIZE = flags.DEFINE_integer('size', 768, 'Matrix size of the step (sets its device time).')
_OUT = flags.DEFINE_string('out', None, 'JSON output path.')

_WORKER = r'''
import json, os, sys, time
pid, nproc, port, iters, rounds, host_ms, size = sys.argv[1:8]
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'
import jax, jax.numpy as jnp, numpy as np
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=int(nproc),
                           process_id=int(pid))
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl_ga import checkpoint
size = int(size)
mesh = jax.make_mesh((jax.device_count(),), ('data',))
x = jax.device_put(np.ones((jax.device_count() * 64, size), np.float32),
                   NamedSharding(mesh, P('data')))
w = jnp.ones((size, size), jnp.float32) / size
step = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(jnp.tanh(x @ w) @ w) @ w) @ w)
jax.block_until_ready(step(x, w))
times = {'all-gather (old)': [], 'preemption service (new)': []}
n = 0
for r in range(int(rounds)):
  for mode in times:
    jax.config.update('jax_enable_preemption_service', mode.startswith('preemption'))
    with checkpoint.PreemptionGuard() as guard:
      y = x
      t0 = time.perf_counter()
      for i in range(int(iters)):
        y = step(y, w)
        time.sleep(float(host_ms) / 1000)  # the host builds the next batch meanwhile
        n += 1
        assert not guard.should_stop_at(n)
      jax.block_until_ready(y)
      times[mode].append((time.perf_counter() - t0) / int(iters) * 1000)
t0 = time.perf_counter()
for i in range(int(iters)):
  x2 = jax.block_until_ready(step(x, w))
device_ms = (time.perf_counter() - t0) / int(iters) * 1000
if jax.process_index() == 0:
  print(json.dumps({'ms_per_iteration': times, 'device_ms_per_step': device_ms}))
'''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def main(argv):
  del argv
  for name, flag, low in (('num_processes', _NUM_PROCESSES, 2), ('iters', _ITERS, 1),
                          ('rounds', _ROUNDS, 1), ('size', _SIZE, 1)):
    if flag.value < low:
      raise machine.BadInput(f'--{name}={flag.value}: must be >= {low}.')
  host_memory.quiet_absent_tpu()  # the workers inherit it: an idle libtpu's warnings
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env['PYTHONPATH'] = machine._REPO  # pylint: disable=protected-access
  procs = [subprocess.Popen(
      [sys.executable, '-c', _WORKER, str(i), str(_NUM_PROCESSES.value), str(port),
       str(_ITERS.value), str(_ROUNDS.value), str(_HOST_MS.value), str(_SIZE.value)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(_NUM_PROCESSES.value)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise SystemExit(f'a worker failed:\n{err[-3000:]}')
  result = json.loads(outs[0][0].strip().splitlines()[-1])
  median = lambda v: sorted(v)[len(v) // 2]
  print(f'{_NUM_PROCESSES.value} processes, host work {_HOST_MS.value:.0f} ms/iteration, '
        f'device step {result["device_ms_per_step"]:.1f} ms (alone)\n')
  print('| check | ms per iteration (median of rounds) | rounds |')
  print('|---|---|---|')
  for mode, values in result['ms_per_iteration'].items():
    print(f'| {mode} | {median(values):.1f} | {", ".join(f"{v:.1f}" for v in values)} |')
  if _OUT.value:
    machine.write_json(_OUT.value, {'machine': machine.machine_info(), 'flags': {
        'num_processes': _NUM_PROCESSES.value, 'iters': _ITERS.value, 'rounds': _ROUNDS.value,
        'host_ms': _HOST_MS.value, 'size': _SIZE.value}, **result})


if __name__ == '__main__':
  machine.run(main)
