"""The gateway family of the bench: figures measured behind the SMG gateway (bench/gateway/phase.py)."""
