"""Backends behind one abstract group API."""
