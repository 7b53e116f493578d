"""Gradient-exchange engine: bucketing, overlap, the sim driver and the DDP adapter."""
