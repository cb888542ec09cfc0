"""Stress: the pressure run (working set > GPU cache) and the soak with storage faults."""
