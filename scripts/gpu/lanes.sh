#!/usr/bin/env bash
# Runs GPU test selections side by side on the device machine, one pytest per lane, each under a time limit,
# and leaves what the device call brings back under $OUT in one archive, lanes.tgz (a call returns at most 8
# files): each lane's log and the evidence the tests write, in a folder per lane (TWINKLE_EVIDENCE_DIR =
# lanes/ev/laneN: the same test in two lanes, e.g. two megatron-cores, keeps both records). Prints each
# lane's test lines and its exit status.
#   bash scripts/gpu/lanes.sh LIMIT_S "GPUS|PYTEST ARGS" ["GPUS|PYTEST ARGS" ...]
# e.g.
#   bash scripts/gpu/lanes.sh 480 "0|tests/test_patches_gpu.py tests/test_convert.py" "1|tests/test_sft_gpu.py"
#   bash scripts/gpu/lanes.sh 300 "0,1|tests/test_launch_gpu.py -k two_gpus"
# Leading NAME=VALUE words set that lane's environment, e.g. a core_v0.16.1 lane beside core_v0.19.0 ones:
#   "0|MEGATRON_LM_ROOT=/tmp/gpu/mlm16 PYTHONPATH=/tmp/gpu/mlm16:\$PYTHONPATH tests/test_launch_gpu.py -k graphs"
# Lanes start together: give them distinct GPUs. Each has its own PYTEST_XDIST_WORKER, so the launch tests'
# rendezvous ports come from distinct blocks: eight (tests/conftest.py, free_port), so at most eight lanes, and
# a pytest started beside them takes a worker name between theirs and gw7. A vLLM lane (tests/test_vllm_gpu.py)
# needs a GPU no other lane uses: vLLM's start-up refuses to run while another process frees GPU memory.
# "rc 124" is a lane its limit stopped: the test then running and those after it did not finish (they did not
# fail). Leave a call's limit some seconds above LIMIT_S.
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
# shellcheck disable=SC1091  # written on the device machine by ../shared/gpu/install.sh
[ -f /tmp/gpu/env.sh ] && source /tmp/gpu/env.sh
limit=$1
shift
out=${OUT:?OUT is not set: the device call sets it to the folder it brings back}
work=$out/lanes
mkdir -p "$work/logs" "$work/ev"
n=0
for lane in "$@"; do
  n=$((n + 1))
  gpus=${lane%%|*}
  args=()
  eval "args=(${lane#*|})" # the shell's own quoting: -k "a or b" stays one argument
  lane_env=()
  while [ ${#args[@]} -gt 0 ] && [[ ${args[0]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
    lane_env+=("${args[0]}")
    args=("${args[@]:1}")
  done
  (
    mkdir -p "$work/ev/lane$n"
    CUDA_VISIBLE_DEVICES=$gpus PYTEST_XDIST_WORKER=gw$n TWINKLE_EVIDENCE_DIR=$work/ev/lane$n \
      env "${lane_env[@]}" timeout "$limit" \
      "${PYTHON:-python}" -m pytest -v -rs -m gpu -p no:cacheprovider "${args[@]}" >"$work/logs/lane$n.log" 2>&1
    # on a line of its own: a stopped test leaves its line unterminated
    printf '\nlane %s (GPUs %s) rc %s\n' "$n" "$gpus" "$?" >>"$work/logs/lane$n.log"
  ) &
done
wait
for i in $(seq 1 "$n"); do
  grep -E " (PASSED|FAILED|ERROR|SKIPPED)|^lane [0-9]+ \(GPUs" "$work/logs/lane$i.log"
done
tar czf "$out/lanes.tgz" -C "$out" lanes && rm -rf "$work"
