"""`kvcompile make-model`: write a synthetic GGUF (random weights, real tokenizer).

    kvcompile make-model --arch qwen35 --preset seed-27b --out seed27b.bf16.gguf --type bf16

Geometry comes from a preset, any field of which can be overridden (`--set n_layers=8`).
Tensors are generated and written one by one, so the model never has to fit in RAM; the
disk must hold it (the plan's size is checked against free space before writing).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.errors import KvcompileError, ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.synthetic_presets import PRESETS, SyntheticConfig, preset_config

if TYPE_CHECKING:
    from kvcompile.io.gguf.synthetic import PlannedTensor

# synthetic.WEIGHT_TYPES' names (tests/test_cli_newcomer.py checks they agree): the parser
# lists them without importing the writer, which imports torch.
WEIGHT_TYPE_NAMES = ("bf16", "f16", "f32", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "q4_0", "q4_1",
                     "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0")


def make_model(arch: str, preset: str, out_path, weight_type: str = "f32", seed: int = 0,
               progress: bool = False, **overrides) -> list[PlannedTensor]:
    """Write the synthetic model; returns the tensor plan that was written."""
    from kvcompile.io.gguf.synthetic import tensor_plan, write_synthetic_gguf

    cfg = preset_config(arch, preset, **overrides)
    plan = tensor_plan(cfg, weight_type)
    out = Path(out_path)
    if out.is_dir():
        raise ModelFileError(f"--out {str(out)!r} is a folder; give a file name ending in .gguf")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ModelFileError(f"folder {str(folder)!r} for --out does not exist; create it first")
    need, free = sum(t.n_bytes for t in plan), shutil.disk_usage(folder).free
    if need > free:
        raise ModelFileError(f"the model needs {need / 2**30:.1f} GiB but {str(folder)!r} has "
                             f"{free / 2**30:.1f} GiB free; free space or pick a smaller "
                             f"preset / weight type")
    return write_synthetic_gguf(cfg, out, weight_type, seed=seed, progress=progress)


def describe(cfg: SyntheticConfig, plan: list[PlannedTensor]) -> str:
    """One line, with the units and rounding of `kvcompile info` on the written file."""
    from kvcompile.io.model_info import format_bytes, format_count

    n_params = sum(_numel(t.shape) for t in plan)
    n_bytes = sum(t.n_bytes for t in plan)
    parts = [f"{cfg.arch} {cfg.name}: {cfg.n_layers} layers"]
    if cfg.hybrid:
        n_attn = sum(cfg.is_full_attention(i) for i in range(cfg.n_layers))
        parts.append(f"({n_attn} attention + {cfg.n_layers - n_attn} Gated DeltaNet, "
                     f"{cfg.nextn_layers} MTP)")
    parts.append(f"hidden {cfg.hidden}, vocab {cfg.vocab_size}: {format_count(n_params)} params, "
                 f"{format_bytes(n_bytes)} in {len(plan)} tensors")
    return " ".join(parts)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def add_make_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--arch", required=True, choices=sorted(PRESETS),
                        help="model family (its GGUF architecture: llama for mistral)")
    parser.add_argument("--preset", default="tiny",
                        help="geometry: " + "; ".join(f"{a}: {', '.join(p)}"
                                                      for a, p in PRESETS.items()))
    parser.add_argument("--out", "-o", required=True, help="output .gguf file")
    parser.add_argument("--type", "--outtype", dest="weight_type", default="f32",
                        choices=WEIGHT_TYPE_NAMES, help="weight type of the matrices")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="override a preset field, e.g. --set n_layers=8 (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the tensor plan's size and write nothing")
    return parser


def parse_overrides(items: list[str]) -> dict:
    fields = SyntheticConfig.__dataclass_fields__
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise UnsupportedModelError(f"--set {item!r}: expected FIELD=VALUE with FIELD one "
                                        f"of {', '.join(fields)}")
        kind = fields[key].type
        try:
            out[key] = (float(value) if "float" in str(kind)
                        else value if kind in ("str", str) else int(value))
        except ValueError:
            raise UnsupportedModelError(f"--set {item!r}: {value!r} is not a number") from None
    return out


def run_make_model(args: argparse.Namespace) -> int:
    """CLI body: returns a process exit code, errors as one readable line."""
    from kvcompile.io.gguf.synthetic import tensor_plan

    try:
        overrides = parse_overrides(args.overrides)
        cfg = preset_config(args.arch, args.preset, **overrides)
        plan = tensor_plan(cfg, args.weight_type)
        print(describe(cfg, plan))
        if args.dry_run:
            return 0
        make_model(args.arch, args.preset, args.out, args.weight_type, args.seed,
                   progress=True, **overrides)
    except KvcompileError as exc:
        print(f"kvcompile: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {os.fspath(args.out)}")
    return 0


def main(argv=None) -> int:
    parser = add_make_model_args(argparse.ArgumentParser(prog="kvcompile make-model",
                                                         description=__doc__.splitlines()[0]))
    return run_make_model(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
