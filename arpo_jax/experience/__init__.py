"""From a rollout to a training batch: the host-side phases of the RL step as pure functions (numpy).

`Trainer.train_step` calls them in order, per rollout worker:

  rollout     `collection.collect`: this step's rollouts of every local worker, with dynamic sampling's extra
              draws (with `rollout.max_staleness` > 0 collected during the previous step's update: `RolloutAhead`);
  reward      `reward.score_rollout` (decode, score: spec 7.2), `reward.shape_rollout` (failures and overlong
              responses masked, the DAPO overlong penalty), `trajectories.select_groups` (dynamic sampling's pick);
  advantages  `advantages.outcome_advantages` (GRPO family, per prompt group: spec 8.1), or with a critic
              `gae_inputs` -> `gae` -> `response_to_tokens` (spec 8.2), token-aligned arrays per trajectory;
  pack        `global_batch.GlobalBatch`: each worker's `layout` (flat, `packing`, or prefix trees, `tree_packing`)
              and its block of the global batch (loss weights from the totals of every worker);
  metrics     `step_metrics`: rollout, update, validation and weight-sync metrics, per-trajectory records.

Nothing here touches a model or another process: what needs them (the rollout itself, the critic's values, totals
over all processes, whitening over the global batch) is passed in. Only `global_batch` places arrays on devices.
"""
