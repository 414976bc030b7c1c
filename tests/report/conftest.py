"""Fixtures of the report tests (the samples live in report_samples.py, importable by name)."""

from report_samples import _seed, plans, profile, sample_report, verification  # noqa: F401
