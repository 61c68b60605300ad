"""`twinpipe compare` from plan to verdict: two stacks side by side on every rank.

- `cli`: the command: arguments, the plan every rank runs, launching, printing, writing;
- `controls`: the routing controls' flags (the trainer's ``[moe]`` names), applied to the
  model's config;
- `rank`: `RankPlan`, and `Rank`: one rank's stacks and the instruments it measures them
  with;
- `arithmetic`: how a rank computes (its device, TF32 off, bfloat16 products) and the
  report's device section;
- `lockstep`: the order of a step (the float32 truth, the baseline, the candidate, the
  comparisons, the updates), lockstep or free, and the evaluation after the last;
- `record`: `StepRecord`, what a rank sends back for each step;
- `instruments`: the interface every instrument follows, the communication count and
  the routing tapes;
- `meter`: each stack's peak memory per region (`harness.memory`'s tracker);
- `routing_counts`: each router call's expert histogram, for the observed-routing
  estimate;
- `ops_audit`: the candidate's ops against plain PyTorch on the run's own inputs;
  `op_checks`: what it checks of one call;
- `spill`: the float32 truth's gradients and AdamW's parked moments in files;
- `stacks`: the stacks by name, and how their state is shared, copied or loaded;
- `inplace`: each rank's tensors reduced to scalars where they live;
- `noise_floor`: the bfloat16 verdict against the float32 truth;
- `tolerances`: DESIGN.md's fixed bounds, and a whole-tensor comparison for one process;
- `verdict`: the report from the ranks' records;
- `balancing`: each stack's balancing losses, load and expert biases, read on a rank and
  judged in the report; `mtp`: each stack's multi-token-prediction losses, judged beside
  the loss;
- `estimates`: the memory estimator's figures beside each measured peak;
- `communication`: the report's communication section, measured beside predicted;
- `planted`: known bugs to plant in the optimized stack, to see the verdict catch them;
  `planted_balancing`: the routing controls' bugs peers shipped; `planted_mtp`: the
  multi-token prediction's;
- `bisect`: the first layer, stage and tensor where two stacks part, in one rank process.

May import `harness.memory`, `harness.report`, `models`, `optimized` and `reference`;
never `harness.history`.
"""
