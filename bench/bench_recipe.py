"""Wall time and peak memory of the 512-step recipe at full size, excluding checkpoint loading.

    PYTHONPATH=. python3 bench/bench_recipe.py --out recipe.json           # H200, real dimensions
    PYTHONPATH=. python3 bench/bench_recipe.py --tiny --device cpu         # a smoke run of the same code
    PYTHONPATH=. python3 bench/bench_recipe.py --text thinking-general     # the thinking-mode recipe
    PYTHONPATH=. python3 bench/bench_recipe.py --context-tokens 4096       # a long-context recipe

Windows hold `--context-tokens` (128, the design card's) + 382 tokens. The run's text is
`--text`: greedy (the default recipe) or a preset (configs/demo-thinking.yaml's thinking-general):
the base writes every continuation under it, selection scores it on `eval.sampled_continuations`
continuations of each validation context, and the export measures both heads under every default
serving configuration (greedy and the four presets, each sampled one on that many continuations of
each heldout context), as a run does. Under sampling each text is its own window of random tokens,
so the cache pass and the evaluation cost what a run's distinct continuations cost.

A random-weight Qwen3.5-35B-A3B-shaped base and head are built directly on the device
(speed and memory do not depend on the values). The recipe, timed phase by phase, with
the library's own pieces:

0. self-generation: the base writes its greedy continuation (up to 382 tokens) of the
   contexts of the run's windows as a run writes a store's (`selfgen.store.EmbeddedWriter.answers`:
   one decoder for every batch; `--generate-batch-size` a batch, 0 sized to the GPU); `--generate-windows` of the 320 are timed and the whole is extrapolated from
   them (random weights never stop early, so every continuation runs the full budget:
   the worst case); `--extra-generate-batch-sizes` times one more batch at each size given
   (the library's default, `data.self_generate_batch_size`, is 64), outside the recipe's
   sum;
1. target cache: `target_cache.build_cache` runs the frozen base over all 320 windows (256 train +
   32 validation + 32 heldout, 128 + 382 tokens each) and writes the sharded cache to disk. `--compute`
   picks the pass: `fast` (`fastbase.FastBasePass`, 65,536 tokens a forward), `plain`
   (`target.plain_compute`: one transformers forward a window, the canonical targets) or
   `both` (two caches; the recipe time uses the fast one, and the two are compared); `online`
   builds none: training and export run the base's plain forward on every batch
   (`targets.base.OnlineTargets`), as `train.py` does without `data.target_cache`;
2. the base's decoder layers are dropped (a training run that reads the cache loads only
   `embed_tokens` and `lm_head`), unless export's decoder check needs them
   (`--decoder-check-windows`): then the training phase's peak memory includes them;
3. 512 training steps of fc + the two pre-fc norms (fp32 masters, AdamW, clipping),
   2 epochs of one window a step, reading targets from the cache (`target_cache.TargetCache`),
   the step of `occamy_mtp.train.loop.train` without accelerate, with its checkpoint selection:
   the decoder replay on the 32 validation windows before the first step and every 64;
4. export: evaluation of donor and trained head on the 32 heldout windows (3 chained
   steps) from the cache, the reference decoder's check of each head on
   `--decoder-check-windows` heldout prompts at 1, 2 and 3 draft steps (export's
   `eval.decoder_check_windows`, default 1), and the head's tensors written to a
   safetensors file.

With `--generate-windows 320` every phase is measured, none extrapolated:
`whole_recipe_seconds` is then the recipe as one timed run (checkpoint loading excluded).

Triton compilation and autotuning happen inside the timed phases, as in a user's run
(the first forward of each new shape pays them). Windows are random tokens, so
agreement figures mean nothing here; only time and memory.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from occamy_mtp.base import joined
from occamy_mtp.cache import sized_fastbase_tokens
from occamy_mtp.targets import cache as target_cache
from occamy_mtp.targets.base import OnlineTargets, plain_compute, plain_compute_name
from occamy_mtp import files
from occamy_mtp.model.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.decode import decodes_runners
from occamy_mtp.evaluation.offline import evaluate_head
from occamy_mtp.evaluation.served import served_acceptance
from occamy_mtp.evaluation.decoder_check import reference_decoder_check
from occamy_mtp.base.fastbase import FastBasePass
from occamy_mtp.base.tuning import use_tuned_kernel_configs
from occamy_mtp.memory import held_bytes
from occamy_mtp.model.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.config import PRESETS, EvalSettings, Serving, TrainSettings, step_loss_weights
from occamy_mtp.sampling import GREEDY_TEXT, text_sampling
from occamy_mtp.selfgen.store import EmbeddedWriter, batch_key, self_generate
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, tiny_text_config
from occamy_mtp.testing.quantize import keep_in_fp8
from occamy_mtp.train.loop import as_served, head_autocast, lr_at, step_windows, train_step
from report import write_report
from timing import sync

CONTEXT_TOKENS, ANSWER_TOKENS = 128, 382
TRAIN_WINDOWS, VALIDATION_WINDOWS, HELDOUT_WINDOWS, EPOCHS = 256, 32, 32, 2
SELECT_EVERY_STEPS, SERVED_STEPS = 64, EvalSettings().served_steps  # the default's: 1, 2 and 3
FAST_TOKENS_PER_FORWARD = 65536



class Phases:
    """Wall time and peak GPU memory of each phase, and its start-up apart from its work.

    A phase's units (a self-generation batch, a cache shard, a training step, a decoder
    check) are timed as they run (`unit`). The first unit of a kind pays the phase's start-up
    (compilation, autotuning, graph capture) beside its work; a later unit of the same kind
    and size is work alone. start-up = first - the median of the later ones; work = the
    phase's seconds - start-up.

    On CUDA it also counts, per phase, the library's hand-backs of the allocator's cache
    (`memory.available_bytes` calls `torch.cuda.empty_cache` before sizing a batch or a
    logits chunk) and the seconds they take with the device drained before them: what a
    sizing costs where memory is tight (expandable segments unmap the pages handed back).
    """

    def __init__(self, device):
        self.device = device
        self.results: dict[str, dict] = {}
        self.units: dict[str, dict[str, list[float]]] = {}
        self.hand_backs: dict[str, list[float]] = {}
        self._current = ""
        if device.type == "cuda":
            empty_cache = torch.cuda.empty_cache

            def timed_empty_cache():
                torch.cuda.synchronize()
                started = time.perf_counter()
                empty_cache()
                torch.cuda.synchronize()
                self.hand_backs.setdefault(self._current, []).append(time.perf_counter() - started)

            torch.cuda.empty_cache = timed_empty_cache

    def unit(self, kind: str, fn):
        """Run one unit of the current phase, timed (synchronised on each side)."""
        sync(self.device)
        started = time.perf_counter()
        value = fn()
        sync(self.device)
        self.record(kind, time.perf_counter() - started)
        return value

    def record(self, kind: str, seconds: float) -> None:
        """One unit of the current phase, timed by the caller."""
        self.units.setdefault(self._current, {}).setdefault(kind, []).append(seconds)

    def __call__(self, name: str, fn):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        self._current = name
        value = fn()
        sync(self.device)
        self.results[name] = {"seconds": time.perf_counter() - started}
        startup = 0.0
        for times in self.units.get(name, {}).values():
            if len(times) > 1:
                startup += max(0.0, times[0] - statistics.median(times[1:]))
        if name in self.units:
            self.results[name].update(startup_seconds=startup, work_seconds=self.results[name]["seconds"] - startup,
                                      units={kind: [round(t, 3) for t in times] for kind, times in self.units[name].items()})
        if self.device.type == "cuda":
            self.results[name]["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            hand_backs = self.hand_backs.get(name, [])
            self.results[name]["cache_hand_backs"] = {"calls": len(hand_backs), "seconds": round(sum(hand_backs), 3)}
        print(f"{name}: {json.dumps(self.results[name])}", flush=True)
        return value


def identity_for(windows, compute: str) -> target_cache.CacheIdentity:
    digest = hashlib.sha256(json.dumps([w.input_ids for w in windows]).encode()).hexdigest()
    return target_cache.CacheIdentity(
        base={"bench": "random-weight base built on the device"},
        data={"windows_sha256": digest, "compute": compute},
        settings={"format": target_cache.CACHE_FORMAT, "dtype": "bfloat16", "attn_implementation": "sdpa"},
    )


def build(windows, base, directory: Path, compute: str, fast_tokens: int = FAST_TOKENS_PER_FORWARD, phases=None):
    ids = [w.input_ids for w in windows]
    if compute == "fast":
        if not fast_tokens:  # sized to the GPU, as the library's cache pass sizes it
            fast_tokens = sized_fastbase_tokens(base, max(len(i) for i in ids), print)
        fn, name = FastBasePass(base, max_tokens_per_batch=fast_tokens), "fastbase.FastBasePass"
    else:
        fn, name = plain_compute(base), plain_compute_name()
    identity = identity_for(windows, compute)
    timed = fn if phases is None else (lambda shard: phases.unit(f"shard of {len(shard)} windows", lambda: fn(shard)))
    target_cache.build_cache(directory, identity, ids, timed, hidden_size=base.config.hidden_size, compute_name=name)
    return target_cache.TargetCache.open(directory, identity)


def compare_caches(a, b, windows) -> dict:
    match = total = 0
    error = norm = 0.0
    for window in windows:
        ha, ga = a.window_outputs(window.input_ids)
        hb, gb = b.window_outputs(window.input_ids)
        match += int((ga == gb).sum())
        total += ga.numel()
        error += float((ha.float() - hb.float()).pow(2).sum())
        norm += float(hb.float().pow(2).sum())
    return {"greedy_match": match / total, "hidden_rel_error": (error / norm) ** 0.5, "positions": total}


def run_stores(train, validation, heldout_by, selected, servings, sampling, texts, context_tokens) -> list:
    """The rows a run's stores hold, store by store in the order `run.self_generated_needed` names them, as
    (text, context): validation under the selected configuration's texts, heldout under each configuration's,
    and train under the train text (`sampling`). Each split's windows (texts(s) x its prompts here, every
    context random and distinct) are dealt to the texts in equal parts, seed 0 first."""
    stores: dict = {}

    def deal(serving, windows):
        shown = [GREEDY_TEXT] if serving.greedy else [text_sampling(serving, j) for j in range(texts(serving))]
        part = len(windows) // len(shown)
        for j, text in enumerate(shown):
            stores.setdefault(text, []).extend(w.input_ids[:context_tokens] for w in windows[j * part:(j + 1) * part])

    deal(selected, validation)
    for serving in servings:
        deal(serving, heldout_by[serving.label()])
    stores.setdefault(sampling, []).extend(w.input_ids[:context_tokens] for w in train)
    return [(text, context) for text, contexts in stores.items() for context in contexts]


def store_calls(stores: list, how: str) -> list[list[int]]:
    """Which rows of `stores` (`run_stores`) each decoder call takes: `one` all of them, `apart` a store's,
    `shared` one configuration's seeds (`selfgen.store.batch_key`), as `run.write_missing` groups them."""
    if how == "one":
        return [list(range(len(stores)))]
    calls: dict = {}
    for row, (text, _) in enumerate(stores):
        calls.setdefault(batch_key(text) if how == "shared" else text, []).append(row)
    return list(calls.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compute", choices=("fast", "plain", "both", "online"), default="both",
                        help="the target cache's pass (both: two caches, compared), or online: no cache, the base every step")
    parser.add_argument("--steps-per-epoch", type=int, default=TRAIN_WINDOWS, help="fewer for a smoke run")
    parser.add_argument("--workdir", default="", help="where the caches and the export go (default: a temporary directory)")
    parser.add_argument("--generate-windows", type=int, default=64, help="contexts whose continuations are timed (0: skip)")
    parser.add_argument("--generate-batch-size", type=int, default=64, help="0: as many as fit (the library's default)")
    parser.add_argument("--store-batches", choices=("shared", "apart", "one"), default="shared",
                        help="which rows share a decoder call: one configuration's seeds (a run's way on a GPU), a store's, or all")
    parser.add_argument("--generate-only", action="store_true", help="stop after self-generation")
    parser.add_argument("--fast-tokens", type=int, default=FAST_TOKENS_PER_FORWARD,
                        help="tokens a forward of the fast cache pass; 0: as many as fit (the library's default)")
    parser.add_argument("--memory-cap-gib", type=float, default=0.0,
                        help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction), e.g. 79.6 for an "
                             "80 GB H100; the peaks are then checked against it")
    parser.add_argument("--extra-generate-batch-sizes", default="",
                        help="comma-separated batch sizes to time one more batch at each (e.g. 16, the library's default)")
    parser.add_argument("--decoder-check-windows", type=int, default=1, help="heldout prompts decoded by the reference decoder (0: skip)")
    parser.add_argument("--trainable", default="", help="comma-separated train.trainable (default: the library's, fc + pre-fc norms)")
    parser.add_argument("--draft-steps", type=int, default=1, help="train.draft_steps: the chain loss over this many steps")
    parser.add_argument("--step-loss-weights", default="", help="train.step_loss_weights, comma-separated (default: equal)")
    parser.add_argument("--profile-export", default="", help="write the export phase's cProfile (cumulative, top 80) to this file")
    parser.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS, help="context tokens a window holds")
    parser.add_argument("--train-windows", type=int, default=TRAIN_WINDOWS, help="fewer to time a long-context recipe in part")
    parser.add_argument("--validation-windows", type=int, default=VALIDATION_WINDOWS)
    parser.add_argument("--heldout-windows", type=int, default=HELDOUT_WINDOWS)
    parser.add_argument("--text", choices=("greedy", *PRESETS), default="greedy",
                        help="how the base writes the run's text and which configuration selection scores")
    parser.add_argument("--base-weights", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: the base's decoder layers quantized in blocks of 128 x 128 and kept in FP8 "
                             "(model.fp8_weights fp8), before the cap is set")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    context_tokens = args.context_tokens
    device = torch.device(args.device)

    def cap_memory():
        if args.memory_cap_gib:
            torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / torch.cuda.mem_get_info(device)[1],
                                                       torch.cuda.current_device())

    if args.base_weights == "bf16":
        cap_memory()
    torch.manual_seed(0)
    config = tiny_text_config() if args.tiny else text_config_from_dict(QWEN3_5_35B_A3B)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-recipe-"))

    started = time.perf_counter()
    with torch.device(device):
        base = base_model_class(config)._from_config(config, dtype=dtype)
        head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head)).to(dtype)
        for param in head.parameters():  # MTPHead leaves its experts as torch.empty: garbage (NaN at times), not random
            torch.nn.init.normal_(param, std=0.02)
    base.requires_grad_(False).eval()
    if args.base_weights == "fp8":
        # A run reads an FP8 checkpoint a layer at a time and never holds the bf16 base: the base is
        # quantized here on the card, then the cap is set and the peaks counted from there.
        keep_in_fp8(base)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        cap_memory()
    joined.lay_out(base)  # the projections of one input as one weight, as a base opened by the library holds them
    held = held_bytes(base)
    tuned = use_tuned_kernel_configs(device)  # as loading the base does in a run
    if tuned:
        print(tuned)
    settings = TrainSettings()
    settings = dataclasses.replace(
        settings, trainable=tuple(args.trainable.split(",")) if args.trainable else settings.trainable,
        draft_steps=args.draft_steps,
        step_loss_weights=tuple(float(w) for w in args.step_loss_weights.split(",")) if args.step_loss_weights else ())
    trainable = set_trainable(head, settings.trainable)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    donor = copy.deepcopy(head, memo={id(head.shared): head.shared})  # borrows the same embedding and lm_head
    sync(device)
    build_seconds = time.perf_counter() - started

    generator = torch.Generator().manual_seed(1)
    length = context_tokens + ANSWER_TOKENS
    selected = Serving() if args.text == "greedy" else PRESETS[args.text]
    sampling = GREEDY_TEXT if selected.greedy else text_sampling(selected, 0)
    continuations_each = EvalSettings().sampled_continuations
    servings = EvalSettings().serving  # greedy and the four presets

    def random_windows(count: int) -> list[Window]:
        return [Window("random", 0, tuple(torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()),
                       context_tokens) for _ in range(count)]

    def texts(serving: Serving) -> int:
        return 1 if serving.greedy else continuations_each

    train_windows = random_windows(args.train_windows)
    validation = random_windows(args.validation_windows * texts(selected))
    heldout_by = {s.label(): random_windows(args.heldout_windows * texts(s)) for s in servings}
    heldout = heldout_by["greedy"]
    windows = train_windows + validation + [w for ws in heldout_by.values() for w in ws]
    phases = Phases(device)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dimensions": "tiny" if args.tiny else "Qwen3.5-35B-A3B",
        "trainable_parameters": trainable,
        "trainable": list(settings.trainable), "draft_steps": settings.draft_steps,
        "step_loss_weights": list(step_loss_weights(settings)),
        "windows": len(windows),
        "tokens": len(windows) * length,
        "context_tokens": context_tokens,
        "text": args.text,
        "servings_measured": [s.label() for s in servings],
        "sampled_continuations": continuations_each,
        "build_seconds_excluded": build_seconds,
        "base_weights": args.base_weights,
        "base_held_gib": held / 2**30,
    }

    # 0. the base's own continuations of (a timed share of) the contexts, and the decoder check
    if args.generate_windows:
        stores = run_stores(train_windows, validation, heldout_by, selected, servings, sampling, texts,
                            context_tokens)[: args.generate_windows]  # (text, context) rows, a run's stores in order
        contexts = [context for _, context in stores]
        calls = store_calls(stores, args.store_batches)

        def generate():
            # As a run writes its stores (`run.write_missing`): the batch sized once, one decoder for every
            # batch. A decoder a batch, built while the last one's memory is still cached, ran out of memory
            # on fixed segments (bench/results/decode.md). `--store-batches` decides which rows share a
            # decoder call: `shared` one configuration's seeds (`selfgen.store.write_together`, the run's
            # way on a GPU), `apart` a store a call (the run's way before), `one` every row under the
            # selected text in one call (this bench before: a lower bound, not what a run does).
            writer = EmbeddedWriter(base, args.generate_batch_size, sampling)
            size = writer.batch_for(contexts, ANSWER_TOKENS, print)
            if device.type == "cuda":
                stats = torch.cuda.memory_stats(device)
                print(f"memory before the decoder: allocated {stats['allocated_bytes.all.current'] / 2**30:.2f} GiB, reserved "
                      f"{stats['reserved_bytes.all.current'] / 2**30:.2f} GiB, cached in split segments "
                      f"{stats['inactive_split_bytes.all.current'] / 2**30:.2f} GiB", flush=True)
            out = [None] * len(stores)
            sync(device)
            for rows in calls:
                texts_of = [stores[i][0] for i in rows]
                if args.store_batches == "one":
                    texts_of = [sampling] * len(rows)
                sized = EmbeddedWriter(base, size, texts_of[0])  # the batch just sized: no second hand-back
                last = time.perf_counter()
                answers = sized.answers([stores[i][1] for i in rows], [True] * len(rows), ANSWER_TOKENS, set(), print,
                                        samplings=texts_of)
                for index, continuation in answers:
                    out[rows[index]] = continuation
                    if index + 1 == len(rows) or (index + 1) % size == 0:  # a batch's last row: the batch is written
                        now = time.perf_counter()
                        phases.record(f"batch of {index % size + 1}", now - last)
                        last = now
            return out

        continuations = phases("self_generate", generate)
        seconds = phases.results["self_generate"]["seconds"]
        tokens = sum(len(c.tokens) for c in continuations)
        result["self_generate"] = {
            "windows_timed": len(contexts), "batch_size": args.generate_batch_size, "tokens": tokens,
            "tokens_per_second": tokens / seconds, "store_batches": args.store_batches,
            "decoder_calls": len(calls), "rows_per_call": [len(rows) for rows in calls],
            "seconds_for_all_windows_extrapolated": seconds * len(windows) / len(contexts),
        }
    if args.generate_only:
        result["phases"] = phases.results
        write_report(result, args.out)
        return 0
    for size in [int(x) for x in args.extra_generate_batch_sizes.split(",") if x.strip()]:
        contexts = [w.input_ids[:context_tokens] for w in windows[:size]]
        name = f"self_generate_batch{size}"
        continuations = phases(name, lambda c=contexts, b=size: self_generate(base, c, ANSWER_TOKENS, set(), b))
        seconds = phases.results[name]["seconds"]
        tokens = sum(len(c.tokens) for c in continuations)
        result[name] = {
            "windows_timed": len(contexts), "batch_size": size, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "seconds_for_all_windows_extrapolated": seconds * len(windows) / len(contexts),
        }
    # 1. the target cache. With both, the plain pass runs first: kernels the two share (fla's
    # delta rule) are compiled by the time the fast one starts; `--compute fast` alone is cold.
    caches = {}
    for compute in {"both": ("plain", "fast"), "online": ()}.get(args.compute, (args.compute,)):
        caches[compute] = phases(f"cache_{compute}", lambda c=compute: build(windows, base, workdir / f"cache-{c}", c, args.fast_tokens,
                                                                          phases))
    if len(caches) == 2:
        result["fast_vs_plain_cache"] = compare_caches(caches["fast"], caches["plain"], windows)
    targets = OnlineTargets(base) if args.compute == "online" else caches["fast" if "fast" in caches else "plain"]

    # 2. training from the cache needs only the embedding and lm_head of the base
    if not args.decoder_check_windows and args.compute != "online":
        base.model.layers = torch.nn.ModuleList()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # 3. the 512 steps: occamy_mtp.train.loop's own step, with the default settings, without accelerate
    total_steps = EPOCHS * args.steps_per_epoch
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
                                  eps=settings.adam_eps, weight_decay=settings.weight_decay)

    selection_seconds = []

    def select():
        started = time.perf_counter()
        with as_served(head, dtype), head_autocast(head, device, dtype):  # as train.loop.selection_step
            phases.unit("selection", lambda: served_acceptance(targets, head.eval(), validation, SERVED_STEPS, ANSWER_TOKENS,
                                                               serving=selected))
        head.train()
        sync(device)
        selection_seconds.append(time.perf_counter() - started)

    def train():
        head.train()
        select()
        for step in range(total_steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, settings.lr, settings.lr_warmup_steps, settings.lr_min_ratio)
            windows_of_step = step_windows(train_windows, step, settings.windows_per_step, settings.seed)
            phases.unit("step", lambda w=windows_of_step: train_step(head, head, targets, w, optimizer, settings,
                                                                     step_loss_weights(settings), dtype))
            if (step + 1) % SELECT_EVERY_STEPS == 0 or step + 1 == total_steps:
                select()

    phases("train", train)
    result["selection"] = {"measurements": len(selection_seconds), "seconds": sum(selection_seconds)}

    # 4. export: donor and trained evaluated on the heldout windows and checked by the
    # reference decoder (as export.py's `_measure`: every head tensor in the model dtype,
    # so the decoder's head runner is the static one), the head written out
    checks = {}

    def export():
        checked = heldout[: args.decoder_check_windows]
        for model in (donor, head):
            for param in model.parameters():  # as export.py: evaluated as served
                param.data = param.data.to(dtype)
        shared = decodes_runners(base, donor, [w.answer_start for w in checked], ANSWER_TOKENS, max(SERVED_STEPS)) if checked else None
        runners = {model: shared.with_head(model) for model in (donor, head)} if checked else {}  # one base runner, a head runner each
        for name, model in (("donor", donor), ("trained", head)):
            phases.unit("evaluation", lambda m=model: evaluate_head(targets, m.eval(), heldout, draft_steps=3, windows_per_batch=4))
            for serving in servings:  # the served figures of every configuration, as export measures them
                phases.unit(f"served {serving.label()}", lambda m=model, s=serving: served_acceptance(
                    targets, m.eval(), heldout_by[s.label()], SERVED_STEPS, ANSWER_TOKENS, serving=s))
            for k in SERVED_STEPS if checked else ():
                sync(device)
                started = time.perf_counter()
                check = phases.unit(f"decoder check k{k}", lambda m=model, k=k: reference_decoder_check(
                    base, m, checked, k, ANSWER_TOKENS, set(), runners=runners[m]))
                checks[f"{name}_k{k}"] = {"windows": len(checked), "seconds": time.perf_counter() - started,
                                          "decode_seconds": check["decode_seconds"],
                                          "verify_passes": check["measured"]["verify_passes"],
                                          "counts_equal": check["measured"]["proposed"] == check["replayed"]["proposed"],
                                          "decisions_equal": check["decisions_equal"]}
        tensors = {n: p.detach().to(dtype) for n, p in head.named_parameters() if "embed_tokens" not in n and "lm_head" not in n}
        files.save_safetensors(workdir / "mtp-trained.safetensors", tensors)

    if args.profile_export:
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
    phases("export", export)
    if args.profile_export:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(80)
        Path(args.profile_export).write_text(text.getvalue())
    result["decoder_checks"] = checks

    result["steps"] = total_steps
    result["phases"] = phases.results
    recipe = ("train", "export") if not caches else ("cache_fast" if "fast" in caches else "cache_plain", "train", "export")
    result["recipe_seconds"] = sum(phases.results[p]["seconds"] for p in recipe)
    if "self_generate" in result:
        result["recipe_seconds_with_self_generation_extrapolated"] = (
            result["recipe_seconds"] + result["self_generate"]["seconds_for_all_windows_extrapolated"])
    if "self_generate" in result and result["self_generate"]["windows_timed"] == len(windows):
        result["whole_recipe_seconds"] = result["recipe_seconds"] + phases.results["self_generate"]["seconds"]
    if "plain" in caches and "fast" in caches:
        result["recipe_seconds_with_plain_cache"] = result["recipe_seconds"] - phases.results["cache_fast"]["seconds"] + phases.results["cache_plain"]["seconds"]
    if device.type == "cuda":
        result["recipe_peak_gib"] = max(phases.results[p]["peak_gib"] for p in recipe)
        result["whole_peak_gib"] = max(phase["peak_gib"] for phase in phases.results.values())
        result["memory_cap_gib"] = args.memory_cap_gib or None
        result["peak_under_cap"] = None if not args.memory_cap_gib else result["whole_peak_gib"] < args.memory_cap_gib
    result["workdir"] = str(workdir)
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
