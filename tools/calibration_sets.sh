#!/bin/bash
# bench_calibration's emulated sets side by side on a many-core host (a lent GPU machine's CPUs):
# each set on two CPUs of its own, its ranks pinned one to each, so the sets do not share cores.
#   tools/calibration_sets.sh OUT_DIR [SET ...]     SET: heterogeneous or homogeneous
# (default: heterogeneous heterogeneous homogeneous). Extra bench flags in BENCH_FLAGS (default
# "--rounds 7 --dilation 8"); each set's log and JSON go to OUT_DIR/<n>-<set>.{log,json}, and all of
# them into one archive, OUT_DIR.tar.gz (for a machine that sends back only a few files).
set -u
out=${1:?usage: tools/calibration_sets.sh OUT_DIR [SET ...]}
shift
if [ $# -gt 0 ]; then sets=("$@"); else sets=(heterogeneous heterogeneous homogeneous); fi
mkdir -p "$out"
cpus=($(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)))"))
if [ $(( ${#sets[@]} * 2 )) -gt ${#cpus[@]} ]; then
  echo "calibration_sets: ${#sets[@]} sets need $(( ${#sets[@]} * 2 )) CPUs, this host gives ${#cpus[@]}" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
for i in "${!sets[@]}"; do
  a=${cpus[$((2 * i))]} b=${cpus[$((2 * i + 1))]}
  PYTHONPATH="$root" PYTHONUNBUFFERED=1 taskset -c "$a,$b" python3 "$root/benchmarks/bench_calibration.py" \
    --emulate "${sets[$i]}" --pin-cpus ${BENCH_FLAGS:---rounds 7 --dilation 8} \
    --json "$out/$i-${sets[$i]}.json" > "$out/$i-${sets[$i]}.log" 2>&1 &
done
wait
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
grep -H -E "MAPE .*goal|peak memory" "$out"/*.log
