"""The checkpointing mechanics that measurement and the applied runtime both run.

Below every stage (it imports nothing else of remat), so that `remat.measure` can time exactly
what `remat.apply` runs and `remat.plan` can price by the rule the runtime applies:

- `cacheable`: which op calls selective checkpointing can keep (torch-free: the planner needs it);
- `selective`: the policy that saves the op calls a plan names;
- `region`: one checkpointed call of a run of blocks, with the guard that keeps their buffers
  advancing once per step;
- `caches`: Hugging Face key/value caches turned off where blocks are replayed.

Submodules load on use: importing this package imports nothing heavy.
"""

__all__ = ["cacheable", "caches", "region", "selective"]
