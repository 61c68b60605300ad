"""Real checkpoints at real widths: the measurements of issue 15, as commands.

Not a pytest-benchmark suite (`twinpipe bench` collects only ``bench_*.py``): these write
and read multi-GB checkpoints, so run them by hand, one at a time, under the shared lock
on a shared machine (``flock /tmp/twinpipe-heavy.lock nice -n 5 python -m ...``).

- ``write``: a ``mid-*`` preset built by transformers at random weights in bf16 and saved
  with transformers' ``save_pretrained``; ``--mxfp4`` then re-writes GPT-OSS's experts as
  published (`models.hf.write_mxfp4`), ``--fp8`` DeepSeek-V3's linear weights
  (`models.hf.write_fp8`, 128 x 128 blocks).
- ``load``: `models.from_pretrained` in a fresh process; its peak resident memory (``VmHWM``,
  which counts the checkpoint's mapped pages, and the anonymous memory it allocated) over the
  process's own baseline, against the target 1.10 x the model's bytes + its largest tensor.
- ``export-check``: `twinpipe export` of a training checkpoint in a fresh process (its
  peak), then transformers loads the export and its logits are held against ours.
- ``dry-run``: a published-size layout (default PP=4 DP=8 EP=8) built on the meta device:
  every rank's tensors and bytes to read from the checkpoint (its stages, EP experts and
  FSDP2 rows; `optimized.pipeline.held_rows`), and the totals against the
  checkpoint's size; ``--tensors`` lists each rank's reads.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch

from models.hf import config_from_hf, config_to_hf

_STATUS = re.compile(r"(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB")


def _memory() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v) * 1024 for k, v in _STATUS.findall(f.read())}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _AnonymousPeak:
    """The highest anonymous resident memory (``RssAnon``) while the block runs, sampled
    every 2 ms. ``VmHWM`` also counts the checkpoint's memory-mapped pages, which the
    kernel may drop at any time; this is the memory the load allocated."""

    def __enter__(self) -> _AnonymousPeak:
        self.peak, self._stop = _memory()["RssAnon"], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _memory()["RssAnon"])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _memory()["RssAnon"])


# ---------------------------------------------------------------------- write
def write(args: argparse.Namespace) -> None:
    import transformers

    from models.network import preset

    config = preset(args.model)
    torch.manual_seed(args.seed)
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    hf_config.dtype = torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    out = Path(args.out)
    bf16 = out / "bf16" if args.mxfp4 or args.fp8 else out
    model.save_pretrained(bf16, max_shard_size="1GB")
    del model
    if args.mxfp4:
        from models.hf import write_mxfp4

        write_mxfp4(bf16, out / "mxfp4", max_shard_bytes=1 << 30)
    if args.fp8:
        from models.hf import write_fp8

        write_fp8(bf16, out / "fp8", max_shard_bytes=1 << 30)
    print(json.dumps({"written": str(out), "mxfp4": args.mxfp4, "fp8": args.fp8}))


# ---------------------------------------------------------------------- load
def _load_child(path: str, dtype: str) -> dict:
    from models.hf import from_pretrained

    before = _memory()
    baseline = before["VmRSS"]
    _reset_peak()
    with _AnonymousPeak() as anonymous:
        model = from_pretrained(path, dtype=getattr(torch, dtype))
    peak = _memory()["VmHWM"]
    params = list(model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    target = 1.10 * model_bytes + largest
    return {
        "checkpoint": path, "dtype": dtype, "model_bytes": model_bytes,
        "largest_tensor_bytes": largest, "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak, "peak_over_baseline_bytes": peak - baseline,
        "target_bytes": int(target), "ratio_to_target": (peak - baseline) / target,
        "peak_over_model": (peak - baseline) / model_bytes,
        "anonymous_peak_over_baseline_bytes": anonymous.peak - before["RssAnon"],
        "anonymous_ratio_to_target": (anonymous.peak - before["RssAnon"]) / target,
    }  # fmt: skip


def load(args: argparse.Namespace) -> None:
    print(json.dumps(_in_child("_load_child", args.checkpoint, args.dtype), indent=1))


def _in_child(function: str, *arguments: str) -> dict:
    """``function(*arguments)`` of this module in a fresh interpreter (its own peak)."""
    code = (
        "import json, sys; from benchmarks import checkpoints; "
        f"print('RESULT', json.dumps(checkpoints.{function}(*sys.argv[1:])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *arguments], capture_output=True, text=True, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{function} failed:\n{done.stdout}\n{done.stderr}")


# --------------------------------------------------------------- export-check
def _export_child(checkpoint: str, out: str, max_shard_bytes: str) -> dict:
    from optimized.train import export_checkpoint

    baseline = _memory()["VmRSS"]
    _reset_peak()
    report = export_checkpoint(checkpoint, out, max_shard_bytes=int(max_shard_bytes))
    peak = _memory()["VmHWM"]
    return {
        "export": out, "tensors": report.tensors, "shards": report.shards,
        "total_bytes": report.total_bytes, "largest_tensor_bytes": report.largest_tensor_bytes,
        "baseline_rss_bytes": baseline, "peak_over_baseline_bytes": peak - baseline,
    }  # fmt: skip


NOISE_K = 2.0
"""Our bf16 logits' error against transformers' float32 forward may be this many times
transformers' own bf16 error (the noise floor's ``k``)."""
NOISE_SLACK = 1e-3


def export_check(args: argparse.Namespace) -> None:
    import transformers

    from models.hf import expected_state_shapes, from_pretrained
    from reference.ops import ReferenceOps

    result = _in_child("_export_child", args.checkpoint, args.out, str(args.max_shard_bytes))
    config = config_from_hf(args.out)
    largest = max(s.numel() for s in expected_state_shapes(config).values())
    # The bound: the largest tensor (ours: a layer's experts stacked, bf16) plus one
    # shard's buffer. The streaming writer holds no shard, so it stays well under.
    result["largest_model_tensor_bytes"] = largest * 2
    result["max_shard_bytes"] = args.max_shard_bytes
    result["bound_bytes"] = largest * 2 + args.max_shard_bytes
    result["peak_over_bound"] = result["peak_over_baseline_bytes"] / result["bound_bytes"]
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    logits = {}
    with torch.no_grad():
        ours = from_pretrained(args.out, dtype=torch.bfloat16, ops=ReferenceOps())
        logits["ours"] = ours(ids).float()
        del ours
        for name, dtype in (("hf", torch.bfloat16), ("truth", torch.float32)):
            hf = transformers.AutoModelForCausalLM.from_pretrained(args.out, dtype=dtype)
            hf.set_attn_implementation("eager")
            hf.set_experts_implementation("eager")
            logits[name] = hf(input_ids=ids).logits.float()
            del hf

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # A fixed bound is wrong at real width: two correct bf16 forwards differ by their own
    # rounding (about 2e-2 of the logits at mid-deepseek-v2). As `harness.compare.noise_floor`
    # judges a step, ours is held to transformers' own bf16 error against its float32
    # forward of the same export: at most K times it, plus a slack.
    ours_error, hf_error = rel(logits["ours"], logits["truth"]), rel(logits["hf"], logits["truth"])
    limit = NOISE_K * hf_error + NOISE_SLACK
    result.update(
        logits_relative_l2=rel(logits["ours"], logits["hf"]),
        logits_max_abs_difference=float((logits["ours"] - logits["hf"]).abs().max()),
        ours_bf16_vs_float32=ours_error,
        transformers_bf16_vs_float32=hf_error,
        error_ratio=ours_error / hf_error if hf_error else None,
        limit=limit,
        within_bound=bool(ours_error <= limit),
    )
    print(json.dumps(result, indent=1))


# -------------------------------------------------------------------- dry-run
def _fp8_bytes(shape: tuple[int, ...], first: int, count: int) -> int:
    """Rows ``[first, first + count)`` of a 128 x 128-block FP8 weight: a byte per value,
    and the float32 scale rows that cover them."""
    from models.hf import fp8_grid_shape

    rows, cols = shape
    touched = (first + count - 1) // 128 - first // 128 + 1 if count else 0
    return count * cols + touched * fp8_grid_shape(shape, (128, 128))[1] * 4


def _disk_bytes(name: str, first: int, count: int, shape: torch.Size, fmt: str) -> int:
    """Bytes of rows ``[first, first + count)`` of our tensor ``name`` (whole shape
    ``shape``) in the published on-disk format ``fmt``: bf16, GPT-OSS's experts as MXFP4
    blocks and scales (``mxfp4``), DeepSeek-V3's linear weights in FP8 (``fp8``); an expert
    bias is float32."""
    from models.hf import FUSED_EXPERTS, mxfp4_shapes

    per_row = math.prod(shape[1:])
    if name.endswith("e_score_correction_bias"):
        return count * 4
    if fmt == "mxfp4" and FUSED_EXPERTS.match(name):
        packed = mxfp4_shapes(name, shape).values()
        return sum(count * math.prod(s[1:]) for s in packed)
    if fmt == "fp8" and FUSED_EXPERTS.match(name):  # per expert: gate and up, or down
        rows, cols = shape[1:]
        if name.endswith("gate_up_proj"):
            return count * 2 * _fp8_bytes((rows // 2, cols), 0, rows // 2)
        return count * _fp8_bytes((rows, cols), 0, rows)
    if fmt == "fp8" and _is_fp8(name) and len(shape) == 2:
        return _fp8_bytes(tuple(shape), first, count)
    return count * per_row * 2


def _checkpoint_bytes(name: str, shape: torch.Size, fmt: str) -> int:
    """A whole tensor of the checkpoint (its on-disk name) in format ``fmt``."""
    if fmt == "mxfp4" and name.endswith(("_blocks", "_scales")):
        return shape.numel()
    if fmt == "fp8" and len(shape) == 2 and _is_fp8(name):
        return _fp8_bytes(tuple(shape), 0, shape[0])
    return shape.numel() * (4 if name.endswith("e_score_correction_bias") else 2)


def _is_fp8(name: str) -> bool:
    from models.hf import PUBLISHED_FP8

    return bool(PUBLISHED_FP8.match(name))


def dry_run_report(
    model: str, pp: int = 4, dp: int = 8, ep: int = 8, seq_len: int = 4096,
    bf16: bool = False, partition: str = "estimated", per_rank: bool = False,
    tensors: bool = False,
) -> dict:  # fmt: skip
    """What every rank of a ``model`` preset at PP ``pp`` DP ``dp`` EP ``ep`` reads from the
    published checkpoint, from parts built on the meta device: totals against the
    checkpoint's size; ``per_rank`` adds each rank's count and bytes, ``tensors`` its reads
    (our tensor name, first row, rows -- experts, for routed experts -- and bytes on disk)."""
    from models.hf import MXFP4, expected_hf_shapes, expected_state_shapes, mtp_copy_names
    from models.network import CausalLM, ExpertParallel, preset, state_buffers
    from models.runtime import ParallelConfig, even_partition, rank_chunks
    from optimized.pipeline import default_partition, held_rows

    config = preset(model)
    published = {"gpt_oss": "mxfp4", "deepseek_v3": "fp8"}
    fmt = "bf16" if bf16 else published.get(config.model_type, "bf16")
    parallel = ParallelConfig(
        pp=pp, dp=dp, ep=ep, micro_batches=2 * pp, seq_len=seq_len, dtype="bfloat16"
    )
    if partition == "even":
        stages = even_partition(config.num_hidden_layers, 2 * pp)
    else:  # what twinpipe train uses: the memory estimator's choice
        stages = default_partition(config, parallel)
    shapes = expected_hf_shapes(config, MXFP4 if fmt == "mxfp4" else None)
    whole = expected_state_shapes(config)
    checkpoint = sum(_checkpoint_bytes(n, s, fmt) for n, s in shapes.items())
    # The MTP layers' copies of the embedding and the head: no rank reads them; the parent's
    # check reads each once, with the tensor it copies (`models.hf.mtp_copies`).
    copies = sum(_checkpoint_bytes(n, shapes[n], fmt) for n in mtp_copy_names(config))
    ranks, total, count = [], 0, 0
    for pp_rank in range(pp):
        chunks = rank_chunks(stages, pp_rank)
        for dp_rank in range(dp):
            expert_parallel = ExpertParallel(None, dp_rank % ep, ep)
            with torch.device("meta"):
                part = CausalLM(config, None, expert_parallel, chunks[0] + chunks[1],
                                pp_rank == 0, pp_rank == 0)  # fmt: skip
            rows = held_rows(part, dp, ep, dp_rank)
            # Training-state buffers (an expert bias) are whole on every rank of their stage.
            rows.update({n: (0, b.shape[0]) for n, b in state_buffers(part)})
            reads = [
                {"tensor": n, "first_row": first, "rows": held,
                 "bytes": _disk_bytes(n, first, held, whole[n], fmt)}
                for n, (first, held) in rows.items() if held
            ]  # fmt: skip
            nbytes = sum(r["bytes"] for r in reads)
            rank = {"pp_rank": pp_rank, "dp_rank": dp_rank, "ep_rank": expert_parallel.rank,
                    "layers": len(chunks[0] + chunks[1]), "tensors": len(reads),
                    "bytes": nbytes}  # fmt: skip
            ranks.append({**rank, "reads": reads} if tensors else rank)
            total += nbytes
            count += len(reads)
    report = {
        "model": model, "pp": pp, "dp": dp, "ep": ep,
        "format": {"mxfp4": "bf16 + MXFP4 experts", "fp8": "bf16 + FP8 linear weights"}.get(
            fmt, "bf16"
        ),
        "stages": " ".join(f"{s[0]}-{s[-1]}" if s else "-" for s in stages),
        "checkpoint_bytes": checkpoint, "bytes_read_by_all_ranks": total,
        "mtp_copies_bytes": copies, "bytes_read_by_the_copies_check": 2 * copies,
        "equal": total + copies == checkpoint, "tensor_slices": count,
        "largest_rank_bytes": max(r["bytes"] for r in ranks),
        "smallest_rank_bytes": min(r["bytes"] for r in ranks),
    }  # fmt: skip
    if per_rank or tensors:
        report["ranks"] = ranks
    return report


def _json_one_read_a_line(report: dict) -> str:
    """``report`` as indented JSON with each rank's read on one line (thousands of them)."""
    reads: list[str] = []
    for rank in report.get("ranks", ()):
        for i, read in enumerate(rank.get("reads", ())):
            reads.append(json.dumps(read))
            rank["reads"][i] = f"@read:{len(reads) - 1}"
    text = json.dumps(report, indent=1)
    return re.sub(r'"@read:(\d+)"', lambda m: reads[int(m[1])], text)


def dry_run(args: argparse.Namespace) -> None:
    report = dry_run_report(
        args.model, args.pp, args.dp, args.ep, args.seq_len, args.bf16, args.partition,
        args.per_rank, args.tensors,
    )  # fmt: skip
    print(_json_one_read_a_line(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoints")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("write", help="a mid-* preset saved by transformers (bf16)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mxfp4", action="store_true", help="also write GPT-OSS experts as MXFP4")
    p.add_argument("--fp8", action="store_true", help="also write DeepSeek-V3's weights in FP8")
    p.add_argument("--seed", type=int, default=0)
    p = commands.add_parser("load", help="from_pretrained's peak memory, in a fresh process")
    p.add_argument("checkpoint")
    p.add_argument("--dtype", default="bfloat16")
    p = commands.add_parser("export-check", help="export, then logits against transformers")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-shard-bytes", type=int, default=1 << 30, help="export shard size")
    p = commands.add_parser("dry-run", help="every rank's reads at a published-size layout")
    p.add_argument("--model", required=True)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--bf16", action="store_true", help="GPT-OSS, DeepSeek-V3 as a bf16 checkpoint")
    p.add_argument(
        "--partition", choices=("estimated", "even"), default="estimated",
        help="stage layers: the estimator's choice (as twinpipe train) or even",
    )  # fmt: skip
    p.add_argument("--per-rank", action="store_true", help="list every rank")
    p.add_argument(
        "--tensors", action="store_true",
        help="list every rank's reads: tensor, first row, rows (experts), bytes on disk",
    )  # fmt: skip
    args = parser.parse_args(argv)
    {"write": write, "load": load, "export-check": export_check, "dry-run": dry_run}[args.command](
        args
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
