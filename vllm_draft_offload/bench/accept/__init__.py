"""Acceptance checks: restored vs fresh prefixes, the KV-sensitivity probe, tables."""
