"""Planning: predict peak memory and step time of any plan, and find the fastest under a budget.

Modules: `types` (Segment, Plan, Prediction, Optimality), `budget` (parse_budget), `costs`
(per-block cost registry), `predict`, `policies` (selective policies), `options` (the optimal
search's per-block choices), `chain_problem` (a profile as the DPs' problem), `chain_dp` (the DP
on memory slots), `chain_exact` (the DP in bytes), `slots` (slot sizes and what rounding costs),
`search` (the optimal planner), `available` (strategies a block cannot run), `planners` (plan,
pareto), `infeasible` (errors), `tune` (measured tuning's candidates and choice).
Submodules load lazily: importing this package imports nothing heavy.
"""

__all__ = ["budget", "costs", "predict", "policies", "options", "chain_problem", "chain_dp", "chain_exact", "slots",
           "search", "available", "planners", "infeasible", "tune", "types"]
