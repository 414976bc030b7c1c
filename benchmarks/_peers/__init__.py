"""The pieces of the peers benchmark: workloads, peer strategies, measurement, results, plots."""
