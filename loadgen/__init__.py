"""Workloads, traces, clients, SLO metrics, capacity search, benchmarks and the CLI."""
