"""Integrations with other trainers (TRL)."""
