"""Backends: each implements adapter.backends.base.Backend over one transport.

Backends never import adapter.ops, the torch integration or the launcher.
"""
