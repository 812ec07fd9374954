#!/bin/bash
# Issue 44's worked example end to end (configs/grpo_smollm2_calculator.py): SmolLM2-135M-Instruct
# learns to use a calculator for 2- and 3-digit multiplication. Four stages, each timed (wall,
# CPU, the load average at its start and end), then one table of the 48 held-out questions'
# greedy accuracy with and without the tool:
#
#   1. data: examples/calculator.py DIR (train.jsonl, eval.jsonl, sft.jsonl)
#   2. before: the untrained model's held-out evaluation with the tool and without
#      (the config's :DIR,base run, stopped once its first evaluation is in metrics.jsonl)
#   3. SFT on sft.jsonl's tool-use conversations (:DIR,sft), exported to Hugging Face format
#   4. GRPO with the Calculator on train.jsonl (:DIR,grpo) from the SFT export; its evaluations
#      before and after are "after SFT" and "after GRPO"
#
#   bash examples/run_calculator.sh [DIR]     # default /tmp/calc: the data there, the runs in
#                                             # /tmp/calc_base, /tmp/calc_sft, _sft_hf, _grpo
#
# SFT_FLAGS and GRPO_FLAGS (environment) add --config.* overrides to those stages' runs.
set -euo pipefail
P=$(realpath -m "${1:-/tmp/calc}")
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"
D=$P  # the data; the runs' workdirs are ${P}_<stage>
CFG=configs/grpo_smollm2_calculator.py
T0=$(date +%s)

load() { cut -d' ' -f1-3 /proc/loadavg; }
stage_start() { echo "== $1: start $(date -u +%H:%M:%S) load $(load)"; S0=$(date +%s); }
stage_end() {  # $1: name, $2: CPU seconds
  echo "== $1: ${2} s CPU, $(( $(date +%s) - S0 )) s wall, end load $(load)"
}
timed() {  # run a command, print its CPU seconds (user + sys, children included) on fd 3
  local rc=0
  /usr/bin/time -f '%U %S' -o "$P.time" "$@" || rc=$?
  tail -n 1 "$P.time" | awk '{printf "%.0f", $1 + $2}' >&3  # after "Command exited with ..."
  return $rc
}

rm -rf "${P}_base" "${P}_sft" "${P}_sft_hf" "${P}_grpo"

stage_start data
cpu=$( { timed python examples/calculator.py "$D" >&2; } 3>&1 )
stage_end data "$cpu"

stage_start before
python -m jaxrl_ga.main --config=$CFG:$D,base --workdir="${P}_base" >"${P}_base.log" 2>&1 &
pid=$!
until grep -qs '"grpo_eval"' "${P}_base/metrics.jsonl"; do
  if ! kill -0 $pid 2>/dev/null; then
    cat "${P}_base.log" >&2; echo "the base run failed" >&2; exit 1
  fi
  sleep 2
done
cpu=$(awk '{printf "%.0f", ($14 + $15) / 100}' /proc/$pid/stat)  # clock ticks of 1/100 s
kill -KILL $pid; wait $pid 2>/dev/null || true
grep '\] held-out' "${P}_base.log" || true
stage_end before "$cpu"

stage_start sft
# SFT_FLAGS unquoted on purpose: several --config.* words
# shellcheck disable=SC2086
cpu=$( { timed python -m jaxrl_ga.main --config=$CFG:$D,sft --workdir="${P}_sft" ${SFT_FLAGS:-} \
          2>&1 | tee "${P}_sft.log" | grep -E '^\[sft\] [0-9]+/|held-out|^summary' >&2; } 3>&1 )
stage_end sft "$cpu"

stage_start export
cpu=$( { timed python -m jaxrl_ga.export --checkpoint="${P}_sft/checkpoints/sft" \
          --out="${P}_sft_hf" 2>&1 | grep '^exported' >&2; } 3>&1 )
stage_end export "$cpu"

stage_start grpo
# shellcheck disable=SC2086
cpu=$( { timed python -m jaxrl_ga.main --config=$CFG:$D,grpo --workdir="${P}_grpo" \
          --config.model.hf_path="${P}_sft_hf" ${GRPO_FLAGS:-} \
          2>&1 | tee "${P}_grpo.log" | grep -E '^\[grpo\] [0-9]+/|held-out' >&2; } 3>&1 )
stage_end grpo "$cpu"

echo "== total: $(( $(date +%s) - T0 )) s wall"
python - "${P}_base/metrics.jsonl" "${P}_grpo/summary.json" <<'EOF'
import json, sys
base = next(json.loads(l) for l in open(sys.argv[1]) if '"grpo_eval"' in l)
s = json.load(open(sys.argv[2]))
rows = [('untrained', base.get('accuracy'), base.get('tools/calls_per_episode'),
         base.get('without_tools/accuracy'))]
for name, when in (('after SFT', 'before'), ('after SFT + GRPO', 'after')):
  rows.append((name, s.get(f'eval/accuracy_{when}'), s.get(f'eval/tools/calls_per_episode_{when}'),
               s.get(f'eval/without_tools/accuracy_{when}')))
print('held-out accuracy (48 questions, greedy) | with the tool | calls per episode | without')
for name, tool, calls, alone in rows:
  print(f'{name:40s} | {tool:13.3f} | {calls:17.2f} | {alone:.3f}')
print(f'with the tool: {100 * (rows[-1][1] - rows[0][1]):+.1f} points (untrained -> trained), '
      f'GRPO {100 * (rows[-1][1] - rows[1][1]):+.1f} points over SFT')
EOF
