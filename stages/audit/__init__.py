"""Audits that measure batch invariance instead of asserting it: one module per stage."""
