"""Fixed kernel configs from a machine's autotuning: Triton's on-disk autotune results -> fla's config files.

    python3 bench/kernel_configs.py AUTOTUNE_DIR_OR_TAR occamy_mtp/base/tuned/sm90 --triton 3.6.0

fla's chunked delta-rule kernels (and its conv and l2norm) autotune on their first call in
a process, ~80 s at real size on an H200, ~60 s more for the shapes transformers' forward
hands them. Triton keeps the result on disk (the second process on a machine skips it);
fla reads fixed configs from a folder of `{kernel}.json` files (`base.tuning` points it at
ours). This script turns the `*.autotune.json` files Triton wrote during a run
(`bench/startup_runs.sh` collects them) into that folder: for each kernel whose autotuner
reads fla's files (`FLA_CACHED_KERNELS`), every tuning key met, with the config Triton
chose (the fastest median), added to the entries the folder's files hold already (a key met
again takes the new choice). Other kernels (fla's layer norms) keep autotuning on first use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tarfile
from pathlib import Path

# The kernels of fla 0.6 on our path whose autotuner is fla's `fla_cache_autotune` (it reads
# config files); the rest use Triton's own autotune, which does not.
FLA_CACHED_KERNELS = (
    "causal_conv1d_fwd_kernel",
    "l2norm_fwd_kernel",
    "chunk_local_cumsum_scalar_kernel",
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
    "recompute_w_u_fwd_kernel",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_fwd_kernel_o",
)
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")


def key_hash(key) -> str:
    """fla's entry hash of a tuning key (`fla.ops.utils.cache.AutotuneKey.key_hash`)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def read_results(source: Path) -> list[tuple[str, dict]]:
    """(kernel name, Triton's autotune record) of every `*.autotune.json` under a folder or in a tar."""
    suffix = ".autotune.json"
    if source.is_dir():
        return [(p.name[: -len(suffix)], json.loads(p.read_text())) for p in sorted(source.rglob(f"*{suffix}"))]
    with tarfile.open(source) as tar:
        return [(Path(m.name).name[: -len(suffix)], json.load(tar.extractfile(m)))
                for m in sorted(tar.getmembers(), key=lambda m: m.name) if m.name.endswith(suffix)]


def config_files(results: list[tuple[str, dict]], triton_version: str) -> dict[str, dict]:
    """fla's file contents per kernel: each key met, with the config Triton measured fastest."""
    files: dict[str, dict] = {}
    for name, record in results:
        if name not in FLA_CACHED_KERNELS:
            continue
        config, _ = min(record["configs_timings"], key=lambda pair: pair[1])  # Triton's own choice
        entry = {"autotune_key": record["key"], "config": {f: config.get(f) for f in CONFIG_FIELDS}}
        out = files.setdefault(name, {"kernel_name": name, "triton_version": triton_version, "autotune_entries": {}})
        out["autotune_entries"][key_hash(record["key"])] = entry
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a folder of Triton's *.autotune.json files, or a tar of them")
    parser.add_argument("out", type=Path, help="the folder of fla config files to write")
    parser.add_argument("--triton", required=True, help="the Triton version that measured them (recorded in each file)")
    args = parser.parse_args()
    files = config_files(read_results(args.source), args.triton)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, content in sorted(files.items()):
        existing = args.out / f"{name}.json"
        if existing.is_file():  # keep the keys tuned before (another run's shapes)
            kept = json.loads(existing.read_text())
            content["autotune_entries"] = {**kept.get("autotune_entries", {}), **content["autotune_entries"]}
        (args.out / f"{name}.json").write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {len(content['autotune_entries'])} keys")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
