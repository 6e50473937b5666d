"""Monarch job definitions for clusters (`monarch apply configs.jobs.<file>.job`).

These modules import `monarch` (and, for Kubernetes, the `kubernetes` client);
nothing in `configs` imports them, so loading a recipe never needs either.
"""
