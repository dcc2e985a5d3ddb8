"""A scripted s-step-stale run on one process: what split placement with rollout.max_staleness s (1 or more)
must train on, written out step by step with the loop's own parts (tests/e2e/test_split.py).

    python tests/e2e/stale_driver.py RESULTS.json -- TRAINER ARGS...

Colocated, one rank: before generating step k's batch, the rollout engine is given the actor's weights of
update k-1-s (the initial weights for steps 1 to s+1), kept aside as the actor exported them; then the step
learns on that batch with the rollout's log-probs as the old ones (bypass). Each step's batch and update
metrics go to RESULTS.json, one row per step, to compare with the split run's metrics.jsonl.
"""

from __future__ import annotations

import json
import sys


def main(results: str, argv: list[str]) -> None:
    import torch.distributed as dist

    from spmdrl.parallel import init_distributed

    init_distributed("cpu")
    scripted_stale(results, argv)
    dist.destroy_process_group()


def scripted_stale(results: str, argv: list[str]) -> None:
    from spmdrl.config.checks import validate_config
    from spmdrl.config.parse import parse_config
    from spmdrl.experience import batch_metrics
    from spmdrl.metrics import reduce_metrics
    from spmdrl.parallel import ParallelDims
    from spmdrl.precision import resolve_dtype
    from spmdrl.run.build import ColocatedRun, build
    from spmdrl.run.learn import learn

    cfg, _ = parse_config(argv)
    validate_config(cfg, 1)
    r = build(cfg, ParallelDims.of(cfg, 1).build())
    assert isinstance(r, ColocatedRun)
    dtype = resolve_dtype(cfg.rollout.dtype, "cpu")
    # versions[u]: the weights after update u
    versions = [[(k, v.clone()) for k, v in r.training.actor.export_weights(dtype)]]
    rows = []
    for step in range(1, r.total_steps + 1):
        weights = versions[max(0, step - 1 - cfg.rollout.max_staleness)]
        r.experience.session.actor_changed(lambda w=weights: iter(w))
        r.experience.step = step
        batch, metrics = r.experience.produce(next(r.train_loader), more_prompts=r.train_loader)
        metrics.update(batch_metrics(batch))
        learned, _ = learn(r, r.training, batch, bypass=True)
        metrics.update(learned)
        rows.append({"step": step, **reduce_metrics(metrics, r.group)})
        versions.append([(k, v.clone()) for k, v in r.training.actor.export_weights(dtype)])
    with open(results, "w") as f:
        json.dump(rows, f)
    r.close()
    r.experience.session.engine.close()


if __name__ == "__main__":
    sep = sys.argv.index("--")
    main(sys.argv[1], sys.argv[sep + 1:])
