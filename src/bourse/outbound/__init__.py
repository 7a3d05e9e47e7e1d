"""Outbound adapters other than engines (webhook delivery)."""
