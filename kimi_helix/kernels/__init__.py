"""Compute kernels (pure-torch references and Triton implementations) for Kimi-style hybrid models."""
