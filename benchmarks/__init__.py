"""Benchmarks of remat against the alternatives people use today, measured side by side.

``python -m benchmarks.peers --model gpt`` runs one model through every peer strategy and
remat's plans in one process, interleaving the repeats, and writes a table, a JSON file and a
frontier plot.
"""
