"""The results contract: what every job directory holds (see docs/results.md)."""
