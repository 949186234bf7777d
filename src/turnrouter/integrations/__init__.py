"""Adapters for voice frameworks (optional extras)."""
