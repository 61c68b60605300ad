"""A planted round: single-line bugs in the training semantics, each run against the tests
that cover it. Not part of the suite (pytest collects ``tests/`` only).

Each bug is ``(name, file, original line, mutated line, test files)``. For each, the tree
is copied to a temporary folder (the working tree's tracked and untracked files, or a
git revision's with ``--rev``), the one line is replaced there -- never in the working
tree -- and ``pytest -x`` runs the listed test files that exist in that tree, in order
(the fast, specific ones first). A bug is *caught* when pytest fails (the first failing
test is named), *survived* when every test passes; an original line that is missing or
not unique is reported as such, not run.

    python tools/plant_round.py                  # every bug, on the working tree
    python tools/plant_round.py --rev 0cb0a31    # the same bugs against an older tree
    python tools/plant_round.py --only clip-at-twice-max-norm,adam-no-bias-correction-1
    python tools/plant_round.py --check          # only check that every line is found
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1800


class Bug(NamedTuple):
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    what: str


OBJECTIVE = ("tests/test_semantics_objective.py", "tests/test_ops_cross_entropy_options.py",
             "tests/test_ops_cross_entropy.py", "tests/test_ops_linear_cross_entropy.py",
             "tests/test_train_objective.py")  # fmt: skip
OPTIMIZER = ("tests/test_semantics_optimizer.py", "tests/test_optimizer_config.py",
             "tests/test_optimizer_precision.py", "tests/test_sharding.py")  # fmt: skip
TRAINER = ("tests/test_semantics_trainer.py", "tests/test_train_config.py",
           "tests/test_data.py", "tests/test_train.py")  # fmt: skip
NORMALISATION = ("tests/test_semantics_loss_scale.py", "tests/test_reference_pipeline.py",
                 "tests/test_optimized_pipeline.py", "tests/test_train_objective.py")  # fmt: skip
CHECKPOINT = ("tests/test_semantics_trainer.py", "tests/test_checkpointing.py",
              "tests/test_train.py", "tests/test_optimizer_precision.py")  # fmt: skip

CE_KERNELS = "optimized/ops/cross_entropy_kernels.py"
ADAMW = "optimized/train/optimizer.py"
BUGS = [
    # ------------------------------------------------------------------ the objective
    Bug(
        "smoothing-mean-over-v-plus-1",
        CE_KERNELS,
        "        smooth = tl.where(label_smoothing > 0.0, label_smoothing * (logit_sum / vocab), 0.0)",  # noqa: E501
        "        smooth = tl.where(label_smoothing > 0.0, label_smoothing * (logit_sum / (vocab + 1)), 0.0)",  # noqa: E501
        OBJECTIVE,
        "issue 33's first blind spot: eps * sum(x) / (V + 1)",
    ),
    Bug(
        "smoothing-uniform-gradient-over-v-plus-1",
        CE_KERNELS,
        "    uniform = label_smoothing / vocab",
        "    uniform = label_smoothing / (vocab + 1)",
        OBJECTIVE,
        "the gradient's eps / V term over V + 1",
    ),
    Bug(
        "smoothing-target-weight-forgotten",
        CE_KERNELS,
        "        loss = log_sum_exp - (1.0 - label_smoothing) * target_logit - smooth + z_loss",
        "        loss = log_sum_exp - target_logit - smooth + z_loss",
        OBJECTIVE,
        "the target's (1 - eps) weight dropped from the loss",
    ),
    Bug(
        "z-loss-gradient-factor-1",
        CE_KERNELS,
        "    probability_scale = 1.0 + 2.0 * lse_square_scale * log_sum_exp",
        "    probability_scale = 1.0 + lse_square_scale * log_sum_exp",
        OBJECTIVE,
        "d(s lse^2)/dx = 2 s lse p: the 2 dropped",
    ),
    Bug(
        "z-loss-not-squared",
        CE_KERNELS,
        "        z_loss = lse_square_scale * log_sum_exp * log_sum_exp",
        "        z_loss = lse_square_scale * log_sum_exp * tl.abs(log_sum_exp - 1.0)",
        OBJECTIVE,
        "the z-loss's value off (lse * |lse - 1|), its gradient right",
    ),
    Bug(
        "trainer-drops-label-smoothing",
        "optimized/pipeline/runner.py",
        "            SummedLinearCrossEntropy(label_smoothing, z_loss),",
        "            SummedLinearCrossEntropy(0.0, z_loss),",
        OBJECTIVE,
        "the optimized runner ignores --label-smoothing",
    ),
    # ----------------------------------------------------- normalisation of the loss
    Bug(
        "token-count-includes-ignored",
        "models/runtime/training.py",
        "    return (labels != IGNORE_INDEX).sum().clamp(min=1)",
        "    return torch.tensor(labels.numel(), device=labels.device)",
        NORMALISATION,
        "the mean's denominator counts ignored tokens",
    ),
    Bug(
        "optimized-loss-divided-per-micro-batch",
        "optimized/pipeline/dualpipev.py",
        "            output = self._loss_sum(head_input, labels) / self.token_count",
        "            output = self._loss_sum(head_input, labels) / max(int((labels != -100).sum()), 1) / self.num_micro_batches",  # noqa: E501
        NORMALISATION,
        "each micro-batch's own mean, averaged",
    ),
    Bug(
        "micro-batches-overlap-across-dp",
        "models/runtime/training.py",
        "    first = dp_rank * parallel.micro_batches * size",
        "    first = dp_rank * size",
        NORMALISATION + ("tests/test_semantics_trainer.py",),
        "DP ranks read overlapping rows of the global batch",
    ),
    # ------------------------------------------------------------------ the optimizer
    Bug(
        "clip-at-twice-max-norm",
        ADAMW,
        "            factor = torch.where(norm > max_norm, factor, 1.0)",
        "            factor = torch.where(norm > 2 * max_norm, factor, 1.0)",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "issue 33's second blind spot",
    ),
    Bug(
        "host-clip-at-twice-max-norm",
        ADAMW,
        "        elif norm > max_norm:",
        "        elif norm > 2 * max_norm:",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "issue 33's second blind spot on the host path (a float norm)",
    ),
    Bug(
        "clip-factor-square-root",
        ADAMW,
        "            self.scale = max_norm / (norm + 1e-6)",
        "            self.scale = (max_norm / (norm + 1e-6)) ** 0.5",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "clipped to sqrt(max_norm * norm)",
    ),
    Bug(
        "device-clip-factor-square-root",
        ADAMW,
        "            factor = torch.full_like(norm, max_norm) / (norm + 1e-6)",
        "            factor = (torch.full_like(norm, max_norm) / (norm + 1e-6)) ** 0.5",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "the trainer's on-device factor (a tensor norm) clipped to sqrt(max_norm * norm)",
    ),
    Bug(
        "clip-factor-never-applied",
        ADAMW,
        "            _adamw_blocks(s, state, lr, *self.hyper, scale=self.scale)",
        "            _adamw_blocks(s, state, lr, *self.hyper, scale=1.0)",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "the factor computed, not used",
    ),
    Bug(
        "norm-counts-every-replica",
        ADAMW,
        "            if s.counted:",
        "            if s.counted or not s.fsdp:",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "unsharded DP: each replica's copy enters the global norm",
    ),
    Bug(
        "adam-no-bias-correction-1",
        ADAMW,
        "    step_size = lr / (1 - beta1**step)",
        "    step_size = lr",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "first moment not bias-corrected",
    ),
    Bug(
        "adam-bias-correction-2-not-rooted",
        ADAMW,
        "    correction2_sqrt = (1 - beta2**step) ** 0.5",
        "    correction2_sqrt = 1 - beta2**step",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "sqrt of the correction dropped",
    ),
    Bug(
        "adam-eps-inside-the-root",
        ADAMW,
        "        denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)",
        "        denom = (exp_avg_sq.add(eps).sqrt() / correction2_sqrt)",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "eps under the square root",
    ),
    Bug(
        "adam-betas-swapped",
        ADAMW,
        "        self.hyper = (betas[0], betas[1], eps, weight_decay)",
        "        self.hyper = (betas[1], betas[0], eps, weight_decay)",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "beta1 and beta2 swapped",
    ),
    Bug(
        "decay-skips-norms-and-biases",
        ADAMW,
        "        param.mul_(1 - lr * weight_decay)",
        "        param.mul_(1 - lr * weight_decay * (s.param.dim() > 1))",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "norm weights and biases skip the decay (not the trainer's stated rule)",
    ),
    Bug(
        "zero1-slices-never-gathered",
        ADAMW,
        "                if s.shares_storage:",
        "                if s.shares_storage or not s.fsdp:",
        OPTIMIZER + ("tests/test_semantics_trainer.py",),
        "ZeRO-1: other replicas' updated slices never reach this rank's parameter",
    ),
    # ------------------------------------------------------------------- the schedule
    Bug(
        "trainer-lr-one-step-ahead",
        "optimized/train/trainer.py",
        "            lr = lr_at(step, cfg)",
        "            lr = lr_at(step + 1, cfg)",
        TRAINER,
        "each step uses the next step's learning rate (and logs it)",
    ),
    Bug(
        "cosine-ends-at-the-last-step",
        "optimized/train/schedule.py",
        "    decay_steps = cfg.steps - warmup",
        "    decay_steps = cfg.steps - warmup - 1",
        TRAINER,
        "min_lr reached at the last step instead of one past it",
    ),
    Bug(
        "trainer-ignores-configured-betas",
        "optimized/train/trainer.py",
        "            runner.part, layout, lr=opt.lr, betas=opt.betas, eps=1e-8,",
        "            runner.part, layout, lr=opt.lr, betas=(0.9, 0.95), eps=1e-8,",
        TRAINER,
        "optim.betas not passed to the optimizer",
    ),
    # ------------------------------------------------------------- data order, resume
    Bug(
        "same-permutation-every-epoch",
        "optimized/data/loader.py",
        "                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))",
        "                rng = np.random.Generator(np.random.PCG64([self.seed, 0]))",
        TRAINER,
        "every epoch reads the samples in the same order",
    ),
    Bug(
        "dp-ranks-read-the-same-samples",
        "optimized/data/loader.py",
        "        start = self.offset + self.dp_rank * self.samples_per_rank",
        "        start = self.offset",
        TRAINER,
        "DP ranks read the same samples",
    ),
    Bug(
        "windows-overlap-by-one-more",
        "optimized/data/loader.py",
        "        starts = ids.reshape(-1, 1) * self.seq_len + np.arange(self.seq_len + 1)",
        "        starts = ids.reshape(-1, 1) * (self.seq_len + 1) + np.arange(self.seq_len + 1)",
        TRAINER,
        "sample i starts at i * (L + 1), not i * L",
    ),
    Bug(
        "resume-restarts-the-epoch",
        "optimized/data/loader.py",
        "        self.epoch, self.offset = epoch, offset",
        "        self.epoch, self.offset = epoch, 0",
        TRAINER,
        "a resume reads the epoch from its start again",
    ),
    # -------------------------------------------------------------- checkpoint content
    Bug(
        "checkpoint-moments-swapped",
        ADAMW,
        "            out[key] = state[key] if key in state else self.zero_moment(s)",
        '            out[key] = state[{"exp_avg": "exp_avg_sq", "exp_avg_sq": "exp_avg"}[key]] if key in state else self.zero_moment(s)',  # noqa: E501
        CHECKPOINT,
        "exp_avg saved as exp_avg_sq and back (a resume is exact)",
    ),
    Bug(
        "resume-adam-step-one-behind",
        "optimized/train/checkpointing.py",
        '                "step": torch.tensor(float(step)),  # AdamW keeps it on CPU',
        '                "step": torch.tensor(float(max(step - 1, 1))),  # AdamW keeps it on CPU',
        CHECKPOINT,
        "AdamW's bias correction restarts one step behind on resume",
    ),
    Bug(
        "checkpoint-step-one-early",
        "optimized/train/trainer.py",
        '        state = {"step": done, "loader": self.loader.state_dict(), "run_id": self.run_id,',
        '        state = {"step": done - 1, "loader": self.loader.state_dict(), "run_id": self.run_id,',  # noqa: E501
        CHECKPOINT,
        "the trainer state records the step before the one saved",
    ),
]


def tree_files(rev: str | None) -> Path:
    """A temporary copy of the tree (``rev``: that git revision's)."""
    target = Path(tempfile.mkdtemp(prefix="plant-"))
    if rev:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        return target
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def plant(tree: Path, bug: Bug) -> str | None:
    """Replace the bug's line in ``tree``; a problem, or None."""
    path = tree / bug.file
    if not path.is_file():
        return f"{bug.file} missing"
    lines = path.read_text().split("\n")
    hits = [i for i, line in enumerate(lines) if line == bug.original]
    if len(hits) != 1:
        return f"original line found {len(hits)} times in {bug.file}"
    lines[hits[0]] = bug.mutated
    path.write_text("\n".join(lines))
    return None


def run(bug: Bug, rev: str | None, check_only: bool) -> dict:
    tree = tree_files(rev)
    try:
        problem = plant(tree, bug)
        tests = [t for t in bug.tests if (tree / t).is_file()]
        if problem or check_only:
            return {"verdict": "not planted" if problem else "found", "detail": problem or ""}
        began = time.time()
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"verdict": "timeout", "detail": "", "seconds": time.time() - began}
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
        if done.returncode == 0:
            verdict, detail = "survived", f"{len(tests)} files passed"
        elif done.returncode == 1 and failed:
            verdict, detail = "caught", failed[0]
        else:
            verdict, detail = "error", f"pytest exit {done.returncode}: {done.stdout[-300:]}"
        return {"verdict": verdict, "detail": detail, "seconds": time.time() - began}
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", help="plant into this git revision's tree")
    parser.add_argument("--only", help="comma-separated bug names")
    parser.add_argument("--check", action="store_true", help="only find every line")
    args = parser.parse_args()
    chosen = BUGS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {b.name for b in BUGS}
        if unknown:
            parser.error(f"unknown bug(s): {', '.join(sorted(unknown))}")
        chosen = [b for b in BUGS if b.name in names]
    caught = 0
    print(f"{'bug':44} {'verdict':12} {'s':>6}  caught by / detail", flush=True)
    for bug in chosen:
        result = run(bug, args.rev, args.check)
        caught += result["verdict"] == "caught"
        seconds = f"{result.get('seconds', 0):.0f}"
        print(f"{bug.name:44} {result['verdict']:12} {seconds:>6}  {result['detail']}",
              flush=True)  # fmt: skip
    if not args.check:
        print(f"caught {caught} of {len(chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
