"""Benchmarks: prompt sets, side-by-side speed runs, reports."""
