"""The device check's pieces: sizes, time-limited sections, the checks, the allocator probe, Markdown."""
