#!/usr/bin/env bash
# End-to-end profiles behind the README's "End to end" tables: both tiny models on the local and
# the Ray backends (with the signal-only bound), and the schedule / resharding comparisons with
# emulated NICs. Writes JSON to benchmarks/results/. About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
day=$(date +%F)
flags=(--no-progress --steps 20)

for model in gpt utransformer; do
    jaxreshard profile "$model" "${flags[@]}" --bound --json "$out/profile_${model}_tiny_local_$day.json"
    jaxreshard profile "$model" "${flags[@]}" --backend ray --json "$out/profile_${model}_tiny_ray_$day.json"
done
jaxreshard profile gpt --no-progress --steps 10 --compare-schedules \
    --json "$out/profile_gpt_tiny_schedules_$day.json"
for gbps in 1.25 0.01; do
    for kind in schedules resharding; do
        jaxreshard profile utransformer --config examples/configs/utransformer_emulated.toml \
            --no-progress --steps 8 --emulate-network "$gbps" "--compare-$kind" \
            --json "$out/profile_${kind}_${gbps}GBps.json"
    done
done
