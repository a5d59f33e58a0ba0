#!/usr/bin/env bash
# ft's main job on the local lab: a real 2-node LoRA SFT fine-tune submitted through ft.
# Sets everything up first (venv, lab). Run as root.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
ft="$repo/.venv/bin/ft"
"$ft" lab up
# The lab's object store credentials (lab-only values): the job mirrors its checkpoints there.
eval "$("$ft" lab env)"
submitted="$("$ft" submit "$repo/recipes/tiny-lora-sft.yaml" --json)" || {
    echo "[demo] ft submit failed (its message is above)" >&2
    exit 1
}
run_id="$("$repo/.venv/bin/python" -c 'import json,sys; print(json.loads(sys.argv[1])["run_id"])' "$submitted")"
echo "[demo] run $run_id submitted; following rank 0 (the first run on a machine compiles DeepSpeed's" \
     "CPU collective before its first step: about a minute of silence)"
run_state() {
    "$ft" status "$run_id" --json | "$repo/.venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["state"])'
}
# The rank log appears once the job starts; until then, wait: not past the job's end, nor forever.
waited=0
until "$ft" logs "$run_id" --rank 0 >/dev/null 2>&1; do
    if (( waited % 10 == 0 )); then
        case "$(run_state)" in
            COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)
                echo "[demo] run $run_id ended ($(run_state)) before rank 0 wrote a line: see \`ft logs $run_id\`" >&2
                exit 1 ;;
        esac
    fi
    if (( waited >= 900 )); then
        echo "[demo] rank 0 of run $run_id has not started in 15 min: see \`ft status $run_id\` and \`ft logs $run_id\`" >&2
        exit 1
    fi
    sleep 1
    waited=$((waited + 1))
done
"$ft" logs "$run_id" --rank 0 -f
"$ft" status "$run_id"
state="$(run_state)"
if [[ "$state" != COMPLETED ]]; then
    echo "[demo] run $run_id ended $state: see \`ft logs $run_id --rank 0\`" >&2
    exit 1
fi
echo "[demo] adapter: $("$ft" status "$run_id" --json | "$repo/.venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["run_dir"])')/output"
# Its evaluation passed its gates into the registry, and its receipt is signed: both checked here.
"$ft" adapters ls --name tiny-lora-sft
"$ft" receipt verify "$run_id" || {
    echo "[demo] the receipt of run $run_id does not verify (the findings are above)" >&2
    exit 1
}
echo "[demo] done. Next: source $repo/.venv/bin/activate; eval \"\$(ft lab env)\"; then ft status $run_id," \
     "ft adapters ls, ft report $run_id -o report.html, ft usage (README: \"The local lab\")"
