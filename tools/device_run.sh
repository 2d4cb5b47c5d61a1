#!/usr/bin/env bash
# One GPU session's work (run through the device tool from the repo root, with .whl carried):
#   bash tools/device_run.sh STAGE...     stages: tests, gpu-new, pair (AB, PAIR_*), pytest (PYTEST_ARGS='tests/x.py -k y'), kernels, host-interference, probe-streams, codec-timing, codec-convs, carried-host, encoder, encoder-layouts, decoder-layouts, step-time (STEP_ARGS), ar-timing, flow-calls (FLOW_ARGS='--sms 96', '--kernels varlen --continued --profile'), flow-kernels (FK_ARGS), hift-timing, cosy-frontend, probe (PROBE='engine_probe args'), fish-http, fish-stream, fish-engine, cosy-http,
#                                         cosy-stream, ab (AB_STAGE, default cosy-stream, once per AB variant: AB='name:serve args;name:serve args'; cosy-ab = ab),
#                                         cosy-engine, cosy-stream-engine (the in-process engine beside cosy-stream;
#                                         ENGINE_SETS='--set k=v'), profile-fish, profile-cosy, profile-cosy-stream (PROFILE_ARGS='--set k=v')
# PYSPY=1 (pair; carry the py-spy wheel in .whl): the engine core's GIL holders mid-bench (tools/gil_holders.py);
#   PYSPY_RATE samples a second (default 20: at 100, session 50's sampler fell 3 s behind and kept 24 samples).
# BENCH_ARGS: more `intone bench` options for fish-http / fish-stream (e.g. --reference-pool 16).
# before-after: BEFORE_STAGES (default "fish-http cosy-stream") on .before/ (tools/before_tree.sh COMMIT; carry .before), then here.
# Results land under $OUT (one folder per stage); the last lines printed are a summary.
set -uo pipefail
# TREE: the source tree to run (default this one; `before-after` runs .before/, made by tools/before_tree.sh)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${TREE:-$PWD}/src || exit 1
export PYTHONUNBUFFERED=1 INTONE_CACHE=/tmp/intone-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${N:-320}  # requests per bench stage; CosyVoice3's stages time out after 150 s + N/4 s unless T is set
COSY_FULL=${COSY_FULL:-cosyvoice3-full-response}  # the profile of cosy-http, cosy-engine and profile-cosy
TAG=${TAG:-}  # suffix of the bench output folders (e.g. -process), with SERVE_ARGS for `intone serve`
INTONE="python3 -m intone.cli.main"
summary=()
# MPS=1: every stage under CUDA MPS (processes' kernels side by side, as threads' are; codec.process, frontend.process)
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log && nvidia-cuda-mps-control -d && echo "MPS on"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
healthy() {  # the server on port $1 answers /health with 200
  python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$1/health', timeout=2).status_code != 200)" 2>/dev/null
}
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    # the tests' whole output is kept in $OUT (the device tool returns only the last 12,000 characters printed)
    tests) timeout ${TT:-420} python3 -m pytest -q -m gpu tests --ignore=tests/api/test_openai_sdk.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/tests$TAG.txt" | tail -25 ;;
    # eval: PYTEST_ARGS may quote a -k expression ("a or b"); -v names each test as it ends, so a run cut by TT
    # still says which passed
    pytest) eval "timeout ${TT:-300} python3 -m pytest -v --tb=short -m gpu ${PYTEST_ARGS:?} -p no:cacheprovider" 2>&1 \
        | tee "$OUT/pytest$TAG.txt" | grep -E "PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED|passed|failed|Error" | tail -60 ;;
    kernels) timeout 200 python3 tools/kernel_timing.py ${KT_ARGS:-} 2>&1 | tee "$OUT/kernels.txt" | tail -20 ;;
    # host-interference: a loop-like thread's launches beside neighbour threads' host reads (HI_ARGS='--seconds 5')
    host-interference) timeout 200 python3 tools/host_interference.py ${HI_ARGS:-} 2>&1 | tee "$OUT/host-interference.txt" | tail -12 ;;
    # probe-streams: a talker-shaped chain of small GEMMs beside large ones and bandwidth-bound passes (PROBE_SMS='112,96')
    probe-streams) PROBE_SMS=${PROBE_SMS:-112,96,64} timeout 120 python3 tools/connections_probe.py 2>&1 \
        | tee "$OUT/probe-streams.txt" | tail -30 ;;
    gpu-new) timeout 400 python3 -m pytest -q -m gpu tests/engine/test_cuda_graphs.py tests/api/test_gpu_server.py tests/models/cosyvoice3/test_frontend_torch.py tests/models/fish_s2/test_codec_stream.py -p no:cacheprovider 2>&1 | tail -15 ;;
    # codec-convs: the Fish codec's stateful decode and each of its convolutions (CONVS_ARGS='--whole': the decode only;
    # '--shapes= --hift 12x256,48x256': CosyVoice3's HiFT on full responses' calls instead)
    codec-convs) timeout ${T:-300} python3 tools/codec_convs.py ${CONVS_ARGS:-} 2>&1 | grep -v Warn > "$OUT/codec-convs$TAG.txt"
      grep -A3 "==" "$OUT/codec-convs$TAG.txt" | cut -c1-400 ;;
    # carried-host: one carried codec call alone, its host part against its whole span, kernels, top ops (CH_ARGS)
    carried-host) timeout 240 python3 tools/carried_host.py ${CH_ARGS:-} 2>&1 | grep -v "Warn\|USDT" | tee "$OUT/carried-host.txt" | tail -60 ;;
    codec-timing) timeout 300 python3 tools/codec_timing.py ${CODEC_ARGS:-} 2>&1 | tee "$OUT/codec-timing.txt" | grep -v Warning | tail -40 ;;
    encoder) timeout 200 python3 tools/encoder_timing.py 2>&1 | tee "$OUT/encoder.txt" | tail -30 ;;
    # encoder-layouts: Fish's reference encode channels-first against time-major (ENC_ARGS='--shapes 16x172')
    encoder-layouts) timeout ${T:-200} python3 tools/encoder_layouts.py ${ENC_ARGS:-} 2>&1 | grep -v Warn \
        | tee "$OUT/encoder-layouts$TAG.txt" | tail -12 ;;
    # decoder-layouts: Fish's carried codec decode channels-first against time-major (DEC_ARGS='--shapes 8x25 --top 8')
    decoder-layouts) timeout ${T:-300} python3 tools/decoder_layouts.py ${DEC_ARGS:-} 2>&1 | grep -v Warn \
        | tee "$OUT/decoder-layouts$TAG.txt" | tail -${DEC_TAIL:-12} ;;
    # step-time: Fish's whole step (decode + head) at real size, per ar.sample_candidates (STEP_ARGS)
    step-time) timeout 300 python3 -m intone.bench.step_time --batch 16,64 --context 1024 --codec-dtype float16 \
        ${STEP_ARGS:---sample-candidates 64,0} --out "$OUT/step-time$TAG.json" 2>&1 | grep -v Warn | tail -20 ;;
    ar-timing) timeout 400 python3 tools/ar_step_timing.py ${AR_ARGS:-} 2>&1 | tee "$OUT/ar-timing$TAG.txt" | grep -v Warning | tail -30 ;;
    probe) timeout 300 python3 tools/engine_probe.py ${PROBE:---model random:cosyvoice3 --set frontend.cuda_graphs=true} 2>&1 \
        | tee "$OUT/probe-${PROBE_TAG:-0}.txt" | grep -v Warning | tail -${PROBE_TAIL:-60} ;;
    flow-calls) timeout ${T:-400} python3 -m intone.bench.cosy_flow_calls ${FLOW_ARGS:-} 2>&1 | tee "$OUT/flow-calls.txt" \
        | grep -v Warn | tail -20 ;;
    # flow-kernels: a full-response codec call alone, per flow variant (FK_ARGS='--rows 12 --variant name:dtype:autocast:attention')
    flow-kernels) timeout ${T:-300} python3 tools/flow_kernels.py ${FK_ARGS:-} 2>&1 | grep -v Warn | tee "$OUT/flow-kernels.txt" | tail -20 ;;
    hift-timing) timeout 200 python3 tools/hift_timing.py 2>&1 | tee "$OUT/hift-timing.txt" | grep -v Warn | tail -12 ;;
    cosy-frontend) timeout 200 python3 tools/cosy_frontend_timing.py 2>&1 | tee "$OUT/cosy-frontend.txt" | tail -20 ;;
    fish-http) timeout ${T:-420} $INTONE bench --model random:fish-s2 --profile fish-s2-high-concurrency --preset seedtts-fish \
        --num-requests "$N" --output-dir "$OUT/fish-http$TAG" ${BENCH_ARGS:-} ${SERVE_ARGS:+--serve-args "$SERVE_ARGS"} 2>&1 | grep -v "it/s\]" | tail -20
      tail -5 "$OUT/fish-http$TAG/server.log"; grep -A12 "Where the time" "$OUT/fish-http$TAG/report.md" ;;
    fish-stream) timeout 420 $INTONE bench --model random:fish-s2 --profile fish-s2-high-concurrency --preset seedtts-fish \
        --num-requests "$N" --stream --output-dir "$OUT/fish-stream$TAG" ${BENCH_ARGS:-} ${SERVE_ARGS:+--serve-args "$SERVE_ARGS"} 2>&1 | grep -v "it/s\]" | tail -20
      grep -A12 "Where the time" "$OUT/fish-stream$TAG/report.md" ;;
    fish-engine) timeout 420 python3 -m intone.bench.engine_throughput --model random:fish-s2 \
        --profile fish-s2-high-concurrency --concurrency 64 --num-requests "$N" --warmup 64 \
        --force-output-frames normal:86:30 --out "$OUT/fish-engine.json" 2>&1 | tail -20 ;;
    cosy-http) timeout ${T:-$((150 + N / 4))} $INTONE bench --model random:cosyvoice3 --profile "$COSY_FULL" \
        --preset seedtts-cosyvoice3 --num-requests "$N" --output-dir "$OUT/cosy-http$TAG" ${SERVE_ARGS:+--serve-args "$SERVE_ARGS"} 2>&1 | grep -v "it/s\]" | tail -20
      tail -5 "$OUT/cosy-http$TAG/server.log"; grep -A12 "Where the time" "$OUT/cosy-http$TAG/report.md" ;;
    cosy-stream) timeout ${T:-$((150 + N / 4))} $INTONE bench --model random:cosyvoice3 --profile cosyvoice3-streaming \
        --preset seedtts-cosyvoice3 --num-requests "$N" --stream --output-dir "$OUT/cosy-stream$TAG" ${SERVE_ARGS:+--serve-args "$SERVE_ARGS"} 2>&1 | grep -v "it/s\]" | tail -20
      grep -A12 "Where the time" "$OUT/cosy-stream$TAG/report.md" ;;
    # ab: AB_STAGE (default cosy-stream; e.g. fish-http) once per AB variant; cosy-ab is ab on cosy-stream
    ab|cosy-ab) IFS=';' read -ra variants <<< "${AB:-shipped:;fifo:--set codec.schedule=fifo}"
      for v in "${variants[@]}"; do
        [[ $v == *:* ]] || v="$v:"
        name=$(echo "${v%%:*}" | tr -cd 'A-Za-z0-9_.-')
        N=${AB_N:-256} TAG=-$name SERVE_ARGS="${v#*:}" T=${T:-190} bash "$0" "${AB_STAGE:-cosy-stream}"; done ;;
    # pair: one `intone serve` per AB variant (PAIR_MODEL, PAIR_PROFILE), and PAIR_BENCHES (full, stream) against
    # it in turn: a variant's non-streamed and streamed rows for one start-up (no frame audit: --base-url);
    # a bench named full+tl or stream+tl runs under a profiler window of PROFILE_S (4) seconds: its GPU timeline
    # (the traces stay on the machine, their summaries come back; that row is a diagnostic), e.g.
    # PAIR_BENCHES="stream stream+tl"; +pool: 16 references cycled (the cache's row, beside the fresh one);
    # a variant named before* serves from .before/ (tools/before_tree.sh COMMIT; carry .before): code before/after
    pair) IFS=';' read -ra variants <<< "${AB:?}"
      for v in "${variants[@]}"; do
        [[ $v == *:* ]] || v="$v:"
        name=$(echo "${v%%:*}" | tr -cd 'A-Za-z0-9_.-'); d="$OUT/pair-$name"; mkdir -p "$d"; port=$((18000 + RANDOM % 1000))
        t0=$(date +%s); src=${TREE:-$PWD}/src; [[ $name == before* ]] && src=$PWD/.before/src  # before*: .before's tree
        PYTHONPATH=/tmp/site:$src $INTONE serve --model "${PAIR_MODEL:-random:fish-s2}" --profile "${PAIR_PROFILE:-fish-s2-high-concurrency}" ${v#*:} \
          --host 127.0.0.1 --port $port --trace-frames "$d/frames.jsonl" --profile-dir "$d/profile" > "$d/server.log" 2>&1 & pid=$!
        until healthy $port; do
          kill -0 $pid 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt ${START_T:-300} ] || break; sleep 2; done
        echo "== $name: ready after $(( $(date +%s) - t0 )) s"; grep -i "warm\|graph\|shapes" "$d/server.log" | tail -4
        seed=0
        benches=${PAIR_BENCHES:-full stream}
        healthy $port || { echo "== $name: not ready, no bench"; tail -3 "$d/server.log"; benches=; }
        for b in $benches; do  # each bench its own clips (seed): no reference cache hits
          flag=; [ "${b%%+*}" = stream ] && flag=--stream; seed=$((seed + 100000))
          [[ $b == *+tl* ]] && flag="$flag --profile-seconds ${PROFILE_S:-4}"  # full+tl, stream+tl: a timeline
          [[ $b == *+pool* ]] && flag="$flag --reference-pool 16"  # full+pool: cached references (reported beside)
          # PYSPY=1: which threads of the engine core hold the GIL, sampled mid-bench (PYSPY_AFTER s in, PYSPY_S s)
          [ "${PYSPY:-0}" = 1 ] && (sleep ${PYSPY_AFTER:-8}; core=$(pgrep -f "intone.engine.process" | head -1)
            /tmp/site/bin/py-spy record --pid "$core" --duration ${PYSPY_S:-10} --rate ${PYSPY_RATE:-20} --gil --threads --nonblocking \
              --format raw --output "$d/$b-gil.txt" > "$d/$b-pyspy.log" 2>&1) & spy=$!
          timeout ${T:-150} $INTONE bench --base-url "http://127.0.0.1:$port" --preset "${PAIR_PRESET:-seedtts-fish}" \
            --num-requests "$N" --seed $seed $flag --output-dir "$d/$b" ${BENCH_ARGS:-} 2>&1 | grep -v "req\]" | tail -3
          wait $spy; if [ "${PYSPY:-0}" = 1 ]; then  # py-spy's last lines say whether it kept up
            [ -s "$d/$b-gil.txt" ] && python3 tools/gil_holders.py "$d/$b-gil.txt" --seconds ${PYSPY_S:-10} --rate ${PYSPY_RATE:-20} | head -40
            tail -3 "$d/$b-pyspy.log"; fi
          grep "^| 64\|^- C64" "$d/$b/report.md"; python3 -m intone.bench.tail "$d/$b/results.json" "$d/frames.jsonl" | grep "^|"
          sed -n '/^## GPU timeline/,/^Plots:/p' "$d/$b/report.md" | grep -v '^Plots:\|^```$\|^$' | head -40
        done
        kill $pid; wait $pid
        rm -rf "$d"/*/dataset "$d"/*/*.png "$d"/profile/*/*.json.gz; tar czf "$d.tgz" -C "$OUT" "pair-$name" && rm -rf "$d"; done ;;  # kept if the call is cut
    # The same stages on an older commit's tree (.before/, carried) and on this one, alternating on one machine.
    before-after) [ -d .before/src ] || { echo "no .before/: run tools/before_tree.sh COMMIT and carry .before"; exit 2; }
      for s in ${BEFORE_STAGES:-fish-http cosy-stream}; do
        TREE=$PWD/.before TAG=-before bash "$0" "$s"; TAG=-after bash "$0" "$s"; done ;;
    cosy-stream-engine) timeout ${T:-$((150 + N / 4))} python3 -m intone.bench.engine_throughput --model random:cosyvoice3 \
        --profile cosyvoice3-streaming --stream --concurrency 64 --num-requests "$N" --warmup 64 \
        --force-output-frames normal:128:45 ${ENGINE_SETS:-} --out "$OUT/cosy-stream-engine.json" 2>&1 | tail -20 ;;
    cosy-engine) timeout 500 python3 -m intone.bench.engine_throughput --model random:cosyvoice3 \
        --profile "$COSY_FULL" --concurrency 64 --num-requests "$N" --warmup 64 \
        --force-output-frames normal:128:45 --out "$OUT/cosy-engine.json" 2>&1 | tail -20 ;;
    profile-fish) timeout 300 python3 tools/step_profile.py --model random:fish-s2 --profile fish-s2-high-concurrency ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile-fish.txt" | tail -45 ;;
    profile-cosy-stream) timeout ${T:-300} python3 tools/step_profile.py --model random:cosyvoice3 --profile cosyvoice3-streaming --stream \
        --frames normal:128:45 --steps 200 ${PROFILE_ARGS:-} 2>&1 | grep -v Warn > "$OUT/profile-cosy-stream${TAG}.txt"
      head -40 "$OUT/profile-cosy-stream${TAG}.txt" ;;
    profile-cosy) timeout ${T:-300} python3 tools/step_profile.py --model random:cosyvoice3 --profile "$COSY_FULL" --frames normal:128:45 \
        ${PROFILE_ARGS:-} 2>&1 | grep -v Warn > "$OUT/profile-cosy${TAG}.txt"; head -60 "$OUT/profile-cosy${TAG}.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  rm -rf "$OUT"/*/dataset "$OUT"/*/*.png  # the generated clips: too many files to bring back
  for log in "$OUT"/*/server.log; do  # the first error of a failed run, small enough to bring back
    [ -f "$log" ] && grep -q -m1 "Traceback\|ERROR" "$log" && grep -m1 -B3 -A40 "Traceback\|ERROR" "$log" > "${log%server.log}first-error.txt" \
      && echo "first error in $log:" && head -20 "${log%server.log}first-error.txt"
  done
  # One archive per result folder, as soon as its stage ends: the device tool brings back only a
  # few files per call, and a call cut short keeps what its finished stages wrote.
  for d in "$OUT"/*/; do [ -d "$d" ] && tar czf "${d%/}.tgz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"; done
  summary+=("$stage: $(( $(date +%s) - start )) s")
done
printf '%s\n' "${summary[@]}"
