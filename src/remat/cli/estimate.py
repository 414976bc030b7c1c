"""Placeholder until the command lands; registers nothing."""
