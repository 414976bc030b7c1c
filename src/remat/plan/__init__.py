"""Planning: predict peak memory and step time of any plan, and find the fastest under a budget.

Modules: `types` (Segment, Plan, Prediction), `budget` (parse_budget), `costs` (per-block cost
registry), `predict`, `policies` (selective policies), `chain_dp` (the exact DP), `search`
(the optimal planner's options and slots), `planners` (plan, pareto), `infeasible` (errors).
Submodules load lazily: importing this package imports nothing heavy.
"""

__all__ = ["budget", "costs", "predict", "policies", "chain_dp", "search", "planners", "infeasible", "types"]
